"""The bad-input catalogue: every input a user can get wrong, through `rlflow run`.

Each case asserts the exact one-line message (what is wrong; where: file, line, key or value; how
to fix it), exit code 2, and that run.root is byte-for-byte what it was before: an earlier run's
committed checkpoint there is untouched and nothing new appears (the checks run before anything
is written). Disk-full and tokenizer cases below the CLI are in tests/unit/engine/models/test_loading_bad_inputs.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from conftest import small_config_tree
from rlflow.engine.storage.checkpoint import CheckpointStore
from rlflow.engine.config.stages import PPOConfig
from rlflow.engine.errors import ConfigError
from rlflow.engine.models.loading import load_tokenizer
from rlflow.flows.cli.main import main

SECRET = "sup3rs3cr3t-v4lue"  # a credential that must never reach a message


@pytest.fixture
def root(tmp_path) -> Path:
    """run.root holding an earlier run's committed checkpoint: bad input must leave it as it is."""
    runs = tmp_path / "runs"
    with CheckpointStore(f"{runs}/earlier/round_0/sft").writer(2) as writer:
        writer.write_bytes("model/weights.bin", b"\x00weights" * 64)
        writer.write_json("training_state.json", {"step": 2})
    return runs


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


class Case:
    """What a case builds on: the temp dir, the small assets, a config writer, a data file writer."""

    def __init__(self, tmp: Path, assets: Path, root: Path, other_vocab_model: Path):
        self.tmp, self.assets, self.root, self.other_vocab_model = tmp, assets, root, other_vocab_model
        self.model = str(assets / "tiny-model")

    def config(self, **sections) -> str:
        path = self.tmp / "c.yaml"
        path.write_text(yaml.safe_dump(small_config_tree(self.assets, self.root, **sections)))
        return str(path)

    def overridden(self, *overrides: str) -> tuple[list[str], str]:
        """argv of the plain small config with overrides, and the source its messages name."""
        cfg = self.config()
        return [cfg, *overrides], f"{cfg} (with overrides)"

    def data(self, name: str, content: bytes | str) -> str:
        path = self.tmp / name
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        return str(path)

    def line_of(self, path: str, text: str) -> int:
        return Path(path).read_text().splitlines().index(text) + 1


def run_cli(capsys, argv: list[str]) -> tuple[int, str]:
    code = main(["run", *argv])
    captured = capsys.readouterr()
    assert SECRET not in captured.out + captured.err
    return code, captured.err.strip()


def assert_rejected(capsys, root: Path, argv: list[str], expected: str) -> None:
    before = snapshot(root)
    code, err = run_cli(capsys, argv)
    assert code == 2, err
    assert err == f"rlflow: error: {expected}"
    assert "\n" not in err and "Traceback" not in err
    assert snapshot(root) == before  # nothing written, nothing changed


PPO_KEYS = ", ".join(sorted(PPOConfig.model_fields))
MINI_BATCH = (
    "rl.rollout_batch=16 is not a multiple of rl.mini_batch={}: every mini-batch is one optimizer step, so all"
    " must be the same size; set rl.mini_batch to a divisor of rl.rollout_batch (e.g. {}) or rl.rollout_batch"
    " to a multiple of rl.mini_batch (e.g. {})"
)


def _with(argv_source: tuple[list[str], str], message: str) -> tuple[list[str], str]:
    argv, source = argv_source
    return argv, f"{source}: {message}"


def _top_p_in_file(c: Case) -> tuple[list[str], str]:
    path = c.config(sampling={"top_p": 1.5})
    line = c.line_of(path, "  top_p: 1.5")
    return [path], f"{path}:{line}: invalid value for 'sampling.top_p': 1.5 (Input should be less than or equal to 1)"


def _long_prompts(c: Case) -> tuple[list[str], str]:
    url = c.data("long.jsonl", json.dumps({"prompt": "word " * 40}) + "\n")
    argv = [c.config(data={"prompts": url, "prompt_overflow": "drop", "max_prompt_tokens": 8})]
    return argv, (
        f"data.prompts: {url}: every prompt is longer than data.max_prompt_tokens=8 and was dropped;"
        " raise the limit or set data.prompt_overflow=truncate"
    )


RM_SOURCE = {"name": "rm", "type": "model"}


def _model_copy(c: Case, name: str, config_update: dict | None = None, drop_config: bool = False) -> str:
    """The tiny model copied under the temp dir, its config.json changed or removed."""
    import shutil

    path = c.tmp / name
    shutil.copytree(c.model, path)
    config = json.loads((path / "config.json").read_text())
    if drop_config:
        (path / "config.json").unlink()
    else:
        (path / "config.json").write_text(json.dumps(config | (config_update or {})))
    return str(path)


def _only_a_gguf(c: Case) -> tuple[list[str], str]:
    path = _model_copy(c, "gguf-only", drop_config=True)
    (Path(path) / "model.Q4_1.gguf").write_bytes(b"GGUF" + b"\x00" * 60)
    return [c.config(model={"path": path})], (
        f"model.path '{path}' holds GGUF file(s) (model.Q4_1.gguf) but no config.json: set"
        f" model.gguf_file=model.Q4_1.gguf (dequantised at every load), or convert once with `rlflow import-model"
        f" {path}/model.Q4_1.gguf DEST` and set model.path=DEST"
    )


def _not_gguf(c: Case) -> tuple[list[str], str]:
    (c.tmp / "weights.gguf").write_bytes(b"PK\x03\x04 a zip, not a GGUF file")
    return [c.config(model={"path": str(c.tmp), "gguf_file": "weights.gguf"})], (
        f"model.path '{c.tmp}/weights.gguf' is not a GGUF file (it starts with b'PK\\x03\\x04', not b'GGUF'); give a"
        " .gguf file, a folder holding one, or package:NAME for an installed package that ships one"
    )


def _gguf_quantization_config(c: Case) -> tuple[list[str], str]:
    path = _model_copy(c, "still-quantised", {"quantization_config": {"quant_method": "gguf"}})
    return [c.config(model={"path": path})], (
        f"model.path '{path}': its config.json carries quantization_config {{quant_method: gguf}}, which transformers"
        " refuses to save after training; convert the original GGUF once with `rlflow import-model SRC DEST` (a"
        " clean safetensors directory) and set model.path=DEST"
    )

# name -> (Case -> (argv after "rlflow run", the message after "rlflow: error: "))
CASES: dict[str, Callable[[Case], tuple[list[str], str]]] = {
    # ---- config
    "config: unknown key": lambda c: _with(
        c.overridden("ppo.stepz=3"), f"unknown key 'ppo.stepz' in ppo; valid keys: {PPO_KEYS}"
    ),
    "config: unknown key in the file names its line": lambda c: (
        [p := c.config(ppo={"stepz": 3})],
        f"{p}:{c.line_of(p, '  stepz: 3')}: unknown key 'ppo.stepz' in ppo; valid keys: {PPO_KEYS}",
    ),
    "config: a key that moved names where it went": lambda c: (
        [p := c.config(safety={"max_kl": 0.5})],
        f"{p}:{c.line_of(p, '  max_kl: 0.5')}: 'safety.max_kl' moved to 'kl.pause_above'; rename it there",
    ),
    "config: wrong type": lambda c: _with(
        c.overridden("rl.steps=many"),
        "invalid value for 'rl.steps': 'many' (Input should be a valid integer, unable to parse string as an integer)",
    ),
    "config: out of range": _top_p_in_file,
    "config: mini-batches that do not tile the rollout batch": lambda c: _with(
        c.overridden("rl.mini_batch=6"), MINI_BATCH.format(6, 4, 18)
    ),
    "config: mini-batch larger than the rollout batch": lambda c: _with(
        c.overridden("rl.mini_batch=32"), MINI_BATCH.format(32, 16, 32)
    ),
    "config: unknown algorithm": lambda c: _with(
        c.overridden("algorithm.name=ppo2"),
        "invalid value for 'algorithm.name': 'ppo2' (unknown algorithm.name 'ppo2'; valid: ppo, grpo, rloo,"
        " reinforce_pp, dpo)",
    ),
    "config: GRPO with one sample per prompt": lambda c: _with(
        c.overridden("algorithm.name=grpo"),
        "algorithm.name=grpo compares the samples of one prompt with each other: it needs rollout.n >= 2 samples"
        " per prompt (got 1); e.g. rollout.n=4",
    ),
    "reward: a rule's misspelt argument": lambda c: (
        [c.config(reward={"sources": [RM_SOURCE, {"name": "kw", "type": "keyword", "kwargs": {"keywordz": ["a"]}}]})],
        "reward source 'kw' (type keyword): unknown kwarg 'keywordz'; valid: keywords, mode, ignore_case",
    ),
    "reward: a function that cannot be imported": lambda c: (
        [c.config(reward={"sources": [RM_SOURCE, {"name": "f", "type": "function", "fn": "no_such_module:score"}]})],
        "reward.sources[f].fn: cannot import module 'no_such_module' (No module named 'no_such_module'); is it"
        " installed or on PYTHONPATH?",
    ),
    "config: a credential of the wrong type is not echoed": lambda c: _with(
        c.overridden(f"data.storage_options={SECRET}"),
        "invalid value for 'data.storage_options': *** (Input should be a valid dictionary)",
    ),
    "config: not UTF-8": lambda c: (
        [c.data("latin1.yaml", b"run:\n  name: caf\xe9\n")],
        f"{c.tmp}/latin1.yaml:2: byte 12 of the line (0xe9) is not valid UTF-8; re-save the config as UTF-8",
    ),
    # ---- data
    "data: missing file": lambda c: (
        [c.config(data={"sft": str(c.tmp / "nope.jsonl")})],
        f"data.sft: data file not found: {c.tmp}/nope.jsonl; check the path in the config",
    ),
    "data: unknown URL protocol": lambda c: (
        [c.config(data={"sft": "foo://bucket/sft.jsonl"})],
        (
            "data.sft: cannot read data file foo://bucket/sft.jsonl: unknown URL scheme 'foo://' (Protocol not known:"
            " foo); use a local path, file://, s3:// or another fsspec protocol"
        ),
    ),
    "data: bad JSON line": lambda c: (
        [c.config(data={"prompts": c.data("p.jsonl", '{"prompt": "a"}\n{"prompt": \n')})],
        (
            f"data.prompts: {c.tmp}/p.jsonl:2: malformed JSON (Expecting value at column 12);"
            " write one complete JSON object per line"
        ),
    ),
    "data: bad CSV line": lambda c: (
        [c.config(data={"sft": c.data("sft.csv", "prompt,response\na,b\nc,d,e\n")})],
        (
            f"data.sft: {c.tmp}/sft.csv:3: row has 3 fields but the header has 2;"
            " quote values that contain commas or newlines"
        ),
    ),
    "data: CSV quote never closed": lambda c: (
        [c.config(data={"sft": c.data("q.csv", 'prompt,response\na,b\n"c,d\ne,f\n')})],
        (
            f"data.sft: {c.tmp}/q.csv:3: row has 1 fields but the header has 2; its quoted value runs on to line 4:"
            " check for a missing closing quote"
        ),
    ),
    "data: missing field": lambda c: (
        [c.config(data={"preferences": c.data("pr.jsonl", json.dumps({"prompt": "a", "chosen": "b"}) + "\n")})],
        (
            f"data.preferences: {c.tmp}/pr.jsonl:1: missing field 'rejected'"
            " (preference rows need 'prompt', 'chosen' and 'rejected')"
        ),
    ),
    "data: empty set": lambda c: (
        [c.config(data={"eval_prompts": c.data("e.jsonl", "\n\n")})],
        f"data.eval_prompts: {c.tmp}/e.jsonl contains no records; add at least one row or fix the path",
    ),
    "data: every prompt too long and dropped": _long_prompts,
    "data: non-UTF-8 bytes": lambda c: (
        [c.config(data={"sft": c.data("l1.jsonl", b'{"prompt": "a", "response": "b"}\n{"prompt": "caf\xe9"}\n')})],
        f"data.sft: {c.tmp}/l1.jsonl:2: byte 16 of the line (0xe9) is not valid UTF-8; re-save the file as UTF-8",
    ),
    # ---- models
    "model: missing model path": lambda c: (
        [c.config(model={"path": str(c.tmp / "no-model")})],
        (
            f"model.path '{c.tmp}/no-model' does not exist; give a local HF model directory or a hub id like"
            " Qwen/Qwen2-0.5B-Instruct"
        ),
    ),
    "model: missing reward model path": lambda c: (
        [c.config(rm={"init": str(c.tmp / "no-rm")})],
        (
            f"rm.init '{c.tmp}/no-rm' does not exist; give a local HF model directory or a hub id like"
            " Qwen/Qwen2-0.5B-Instruct"
        ),
    ),
    "model: LoRA target that is not a linear layer": lambda c: (
        [c.config(model={"lora": {"target_modules": ["q_proj", "qkv"]}})],
        (
            "model.lora.target_modules: qkv is not a linear module of LlamaForCausalLM; its linear modules are:"
            ' down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj (or use "all-linear")'
        ),
    ),
    "model: LoRA modules_to_save misspelt": lambda c: (
        [c.config(model={"lora": {"modules_to_save": ["embed_token"]}})],
        "model.lora.modules_to_save: embed_token is not a module with weights of LlamaForCausalLM; e.g. down_proj,"
        " embed_tokens, gate_proj, input_layernorm, k_proj, lm_head, norm, o_proj",
    ),
    "model: a directory holding a GGUF file but no config": _only_a_gguf,
    "model: model.gguf_file that is not GGUF": _not_gguf,
    "model: a quantization_config that cannot be saved": _gguf_quantization_config,
    "model: chat_template auto without a template": lambda c: (
        c.overridden("data.chat_template=auto")[0],
        f"data.chat_template=auto, but the tokenizer of model.path '{c.model}' has no chat template; set"
        " data.chat_template=none to use prompts as written (a base model), or add a chat_template to its"
        " tokenizer_config.json",
    ),
    "model: prompt and response longer than the context": lambda c: (
        c.overridden("sampling.max_new_tokens=100000000")[0],
        "data.max_prompt_tokens=32 + sampling.max_new_tokens=100000000 = 100000032 tokens is more than the model's context"
        f" of 256 (max_position_embeddings of '{c.model}'); lower one of them",
    ),
    "data: a reward model with no pairs to train on": lambda c: (
        [c.config(data={"preferences": None}, label={"online_from_round": None})],
        "data.preferences is null and label.online_from_round=None: the reward model of round 0 has no pairs to"
        " train on; name a preference file or set label.online_from_round=0",
    ),
    "data: a reward model with no held-out pairs": lambda c: (
        [c.config(data={"preferences_eval": None}, label={"online_from_round": 0})],
        "data.preferences_eval is null: the reward model would have no held-out pairs to measure its accuracy on;"
        " name a file, or set label.online_from_round=0 and label.eval_fraction (e.g. 0.2)",
    ),
    "reward: a gym source's misspelt argument": lambda c: (
        [c.config(reward={"sources": [RM_SOURCE, {"name": "g", "type": "gym", "kwargs": {"extrct": "last_number"}}]})],
        "reward source 'g' (type gym): unknown kwarg 'extrct'; valid: extract, credit",
    ),
    "model: reward model with another vocabulary": lambda c: (
        [c.config(rm={"init": str(c.other_vocab_model)})],
        (
            f"rm.init '{c.other_vocab_model}' and model.path '{c.model}' have different vocabularies (200 vs"
            f" {len(load_tokenizer(c.model).get_vocab())} tokens): the reward model scores the policy's token ids,"
            f" so it must share its tokenizer; set rm.init=sft or give a reward model fine-tuned from the model at"
            f" '{c.model}'"
        ),
    ),
}


@pytest.fixture(scope="module")
def other_vocab_model(tmp_path_factory) -> Path:
    """A tiny causal LM whose tokenizer has 200 tokens (the demo model's has about 360)."""
    from rlflow.engine.tasksets.demo import make_tiny_model, make_tokenizer

    tokenizer = make_tokenizer(["the quick brown fox jumps over the lazy dog " * 3, "hello world"], vocab_size=200)
    tokenizer.add_tokens([f"extra{i}" for i in range(200 - len(tokenizer))])  # exactly 200: a stable message
    path = tmp_path_factory.mktemp("other-vocab") / "model"
    make_tiny_model(tokenizer, hidden=32, layers=1).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name, capsys, tmp_path, small_assets, root, other_vocab_model):
    argv, expected = CASES[name](Case(tmp_path, small_assets, root, other_vocab_model))
    assert_rejected(capsys, root, argv, expected)


# ---- more processes than devices: the device counts are faked, the rule is what is tested


def _deepspeed_on(nproc: int, **sections) -> dict:
    """A config that passes the per-rank share checks for `nproc` ranks."""
    base = {"engine": {"backend": "deepspeed"}, "resources": {"nproc_per_node": nproc}}
    return base | {"rollout": {"generate_batch": 4}, "eval": {"batch_size": 8}} | sections


DEVICE_CASES = {
    "4 ranks on 2 GPUs": (
        2, 16, "0,1", _deepspeed_on(4),
        (
            "resources.nproc_per_node=4 but this machine has 2 GPU(s) (CUDA_VISIBLE_DEVICES='0,1'): every rank needs"
            " a GPU of its own - set resources.nproc_per_node to at most 2 or make more GPUs visible"
        ),
    ),
    "2 ranks on a 1-GPU train placement": (
        2, 16, "0,1", _deepspeed_on(2, placement={"train": [1]}),
        (
            "resources.nproc_per_node=2 but placement.train=[1] gives training 1 GPU(s) (CUDA_VISIBLE_DEVICES='0,1'):"
            " every rank needs a GPU of its own - set resources.nproc_per_node to at most 1 or make more GPUs visible"
        ),
    ),
    "4 ranks on 2 CPU cores": (
        0, 2, None, _deepspeed_on(4),
        (
            "resources.nproc_per_node=4 but no GPU is visible (CUDA_VISIBLE_DEVICES unset) and this process may use"
            " 2 CPU core(s): ranks beyond the cores only slow every step down - set resources.nproc_per_node to at"
            " most 2, or run on a machine with GPUs"
        ),
    ),
}


@pytest.mark.parametrize("name", list(DEVICE_CASES))
def test_more_processes_than_devices(name, capsys, monkeypatch, tmp_path, small_assets, root):
    from rlflow.engine.backend import placement

    gpus, cpus, cvd, sections, expected = DEVICE_CASES[name]
    monkeypatch.setattr(placement, "visible_gpu_count", lambda: gpus)
    monkeypatch.setattr(placement, "usable_cpu_count", lambda: cpus)
    if cvd is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cvd)
    argv = [Case(tmp_path, small_assets, root, tmp_path).config(**sections)]
    assert_rejected(capsys, root, argv, expected)


def test_process_count_rule_allows_one_device_per_rank():
    from rlflow.engine.backend.placement import validate_process_count

    # Each allowed count is the largest: one rank more fails, so neither side of the rule can move.
    validate_process_count(2, None, 2, 1, "0,1")  # GPUs decide, not cores
    validate_process_count(1, None, 8, 1, None)  # fewer ranks than GPUs: the first ones are used
    validate_process_count(2, [0, 3], 4, 1, None)
    validate_process_count(2, None, 0, 2, None)  # CPU: one rank per core
    for ranks, train, gpus, cpus, cvd in [(3, None, 2, 1, "0,1"), (3, [0, 3], 4, 1, None), (3, None, 0, 2, None)]:
        with pytest.raises(ConfigError, match=f"resources.nproc_per_node={ranks} but "):
            validate_process_count(ranks, train, gpus, cpus, cvd)


# ---- S3 (the moto server): the message names the bucket, never a credential

BAD_KEYS = {"key": "AKIAEXAMPLEBADKEY0000", "secret": SECRET}
FRESH = {"skip_instance_cache": True}


def _s3_cases(bucket: str, options: dict) -> dict[str, tuple[dict, bool, str]]:
    """name -> (config sections, moto checks credentials, message)."""
    missing, sft = "s3://no-such-bucket-rlflow", f"{bucket}/bad-inputs/sft.jsonl"
    refused = f"access to bucket '{bucket.removeprefix('s3://')}' was refused (Forbidden); check the credentials"
    return {
        "data file in a missing bucket": (
            {"data": {"sft": f"{missing}/sft.jsonl", "storage_options": options}}, False,
            (
                f"data.sft: cannot read data file {missing}/sft.jsonl: bucket 'no-such-bucket-rlflow' does not exist"
                " (The specified bucket does not exist); create it or fix the bucket name in the URL"
            ),
        ),
        "data file with refused credentials": (
            {"data": {"sft": sft, "storage_options": options | BAD_KEYS}}, True,
            (
                f"data.sft: cannot read data file {sft}: {refused} (data.storage_options or the AWS_* environment) and"
                " their permissions on it"
            ),
        ),
        "a storage option s3fs does not take": (
            {"data": {"sft": sft, "storage_options": options | {"sesion_token": SECRET}}}, False,
            (
                f"data.sft: cannot read data file {sft}: data.storage_options holds an option this filesystem does not"
                " take (AioSession.__init__() got an unexpected keyword argument 'sesion_token'); remove or rename it"
            ),
        ),
        "run.root in a missing bucket": (
            {"run": {"name": "t", "root": f"{missing}/rlflow", "storage_options": options}}, False,
            (
                f"run.root '{missing}/rlflow' cannot be written: bucket 'no-such-bucket-rlflow' does not exist"
                " (The specified bucket does not exist); create it or fix the bucket name in the URL"
            ),
        ),
        "checkpoint.mirror in a missing bucket": (
            {"checkpoint": {"mirror": f"{missing}/mirror", "mirror_storage_options": options}}, False,
            (
                f"checkpoint.mirror '{missing}/mirror' cannot be written: bucket 'no-such-bucket-rlflow' does not"
                " exist (The specified bucket does not exist); create it or fix the bucket name in the URL"
            ),
        ),
        "run.root with no credentials anywhere": (
            # a fresh s3fs instance: fsspec's cached one holds the session's test keys
            {"run": {"name": "t", "root": f"{bucket}/bad-inputs-root", "storage_options": options | FRESH}}, "none",
            (
                f"run.root '{bucket}/bad-inputs-root' cannot be written: no credentials for bucket"
                f" '{bucket.removeprefix('s3://')}' were found (NoCredentialsError); set AWS_ACCESS_KEY_ID and"
                " AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment, give key and secret in"
                " run.storage_options, or anon: true there for a public bucket"
            ),
        ),
        "run.root with refused credentials": (
            {"run": {"name": "t", "root": f"{bucket}/bad-inputs-root", "storage_options": options | BAD_KEYS}}, True,
            (
                f"run.root '{bucket}/bad-inputs-root' cannot be written: {refused} (run.storage_options or the AWS_*"
                " environment) and their permissions on it"
            ),
        ),
    }


S3_CASE_NAMES = list(_s3_cases("s3://b", {}))


@pytest.mark.parametrize("name", S3_CASE_NAMES)
def test_s3_errors(name, capsys, tmp_path, small_assets, root, s3_bucket):
    import s3fs
    from moto import settings

    bucket, options = s3_bucket
    fs = s3fs.S3FileSystem(**options)
    fs.pipe_file(f"{bucket}/bad-inputs/sft.jsonl", (small_assets / "data" / "sft.jsonl").read_bytes())
    sections, check_credentials, expected = _s3_cases(bucket, options)[name]
    argv = [Case(tmp_path, small_assets, root, tmp_path).config(**sections)]
    with pytest.MonkeyPatch.context() as mp:
        # moto accepts any key unless it authenticates requests: then unknown keys get a 403.
        mp.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0 if check_credentials is True else float("inf"))
        if check_credentials == "none":  # nothing in the environment, and no request to an instance role
            for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
                mp.delenv(var, raising=False)
            mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
            mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
            mp.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
        assert_rejected(capsys, root, argv, expected)
    fs.invalidate_cache()
    assert not fs.exists(f"{bucket}/bad-inputs-root")  # nothing written to an S3 run.root either

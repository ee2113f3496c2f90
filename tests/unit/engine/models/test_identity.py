"""What identifies a model (rlflow.engine.models.identity): the fingerprint of a local model follows
the bytes and names of its files (first and last MiB of a big one), never their paths or times."""

import hashlib
import os
import shutil

from rlflow.engine.models.identity import HUB_ID, model_fingerprint

MIB = 2**20


def model_dir(root, weights: bytes = b"abc", config: bytes = b"{}"):
    root.mkdir()
    (root / "config.json").write_bytes(config)
    (root / "w.bin").write_bytes(weights)
    return root


def test_a_small_folders_fingerprint_is_sha256_of_each_files_name_size_and_bytes_in_name_order(tmp_path):
    folder = model_dir(tmp_path / "m")
    expected = hashlib.sha256(b"config.json:2" + b"{}" + b"w.bin:3" + b"abc").hexdigest()
    assert model_fingerprint(str(folder)) == f"sha256:{expected}"


def test_the_fingerprint_follows_content_and_names_not_paths_or_times(tmp_path):
    folder = model_dir(tmp_path / "m")
    before = model_fingerprint(str(folder))
    copy = shutil.copytree(folder, tmp_path / "elsewhere")
    assert model_fingerprint(str(copy)) == before
    os.utime(folder / "w.bin", (1_000_000, 1_000_000))  # an older mtime: same bytes, same model
    (folder / "sub").mkdir()  # folders inside are not part of it
    assert model_fingerprint(str(folder)) == before
    (folder / "w.bin").write_bytes(b"abd")  # same size, one byte changed
    assert model_fingerprint(str(folder)) != before
    (folder / "w.bin").write_bytes(b"abc")
    (folder / "w.bin").rename(folder / "x.bin")
    assert model_fingerprint(str(folder)) != before


def test_a_big_weight_file_is_read_at_its_first_and_last_mib_only(tmp_path):
    data = bytearray(3 * MIB)
    folder = model_dir(tmp_path / "m", bytes(data))
    before = model_fingerprint(str(folder))
    data[MIB + 10] = 1  # the middle MiB: not read (cheap at 140 GB), by design
    (folder / "w.bin").write_bytes(bytes(data))
    assert model_fingerprint(str(folder)) == before
    data[-1] = 1  # the last MiB
    (folder / "w.bin").write_bytes(bytes(data))
    assert model_fingerprint(str(folder)) != before
    # a JSON file is hashed whole at any size
    config = b'{"pad": "' + b" " * (3 * MIB) + b'"}'
    changed = config[: MIB + 5] + b"x" + config[MIB + 6 :]
    assert model_fingerprint(str(model_dir(tmp_path / "a", config=config))) != model_fingerprint(
        str(model_dir(tmp_path / "b", config=changed))
    )


def test_a_single_file_counts_as_a_folder_holding_only_it_and_a_hub_id_is_itself(tmp_path):
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "w.gguf").write_bytes(b"GGUF" + bytes(100))
    assert model_fingerprint(str(tmp_path / "g" / "w.gguf")) == model_fingerprint(str(tmp_path / "g"))
    assert model_fingerprint("Qwen/Qwen2-0.5B-Instruct") == "Qwen/Qwen2-0.5B-Instruct"
    assert HUB_ID.match("Qwen/Qwen2-0.5B-Instruct") and HUB_ID.match("HuggingFaceTB/SmolLM2-135M")
    assert not HUB_ID.match("a/b/c") and not HUB_ID.match("/abs/model") and not HUB_ID.match("model")

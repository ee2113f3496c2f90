from prefect.serializers import JSONSerializer

from rlflow.engine.storage.checkpoint import STEP_URI, model_location
from rlflow.tasks.stages import StageResult


def test_stage_result_round_trips_through_prefects_json_serializer():
    result = StageResult(
        stage="ppo",
        round_index=1,
        step=30,
        checkpoint_uri="s3://b/run/round_1/ppo/step_000030",
        manifest_sha256="ab" * 32,
        metrics={"actor/kl": 0.12},
        mlflow_run_id="r1",
        resumed_from=20,
    )
    data = JSONSerializer().dumps(result)
    assert b"pickle" not in data and b"step_000030" in data
    assert JSONSerializer().loads(data) == result


def test_model_location_passes_plain_paths_through():
    assert model_location("Qwen/Qwen2-0.5B-Instruct", {}) == "Qwen/Qwen2-0.5B-Instruct"
    assert STEP_URI.match("runs/x/round_0/sft/step_000012")["step"] == "000012"
    assert STEP_URI.match("runs/x/round_0/sft") is None


"""GGUF files (rlflow.engine.models.gguf): a file written by the gguf package is recognised, anything
else is refused naming what it starts with, and only a quantisation loading undid is dropped."""

from types import SimpleNamespace

import numpy as np
import pytest
from transformers.utils.quantization_config import QuantizationMethod

from rlflow.engine.errors import ConfigError
from rlflow.engine.models.gguf import GGUF_MAGIC, check_gguf_file, is_gguf_file, strip_quantizer


@pytest.fixture
def tiny_gguf(tmp_path) -> str:
    """A real (one-tensor) GGUF file written by the gguf package, as llama.cpp's converters do."""
    import gguf

    path = str(tmp_path / "tiny.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.arange(8, dtype=np.float32).reshape(2, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_written_by_the_gguf_package_is_recognised(tiny_gguf):
    assert is_gguf_file(tiny_gguf)
    check_gguf_file(tiny_gguf, "model.path")  # no error
    with open(tiny_gguf, "rb") as f:
        assert f.read(4) == GGUF_MAGIC == b"GGUF"


def test_other_files_and_missing_paths_are_refused_naming_the_key_and_the_bytes(tmp_path):
    zipped = tmp_path / "w.gguf"
    zipped.write_bytes(b"PK\x03\x04rest")
    assert not is_gguf_file(str(zipped)) and not is_gguf_file(str(tmp_path))  # a folder is no GGUF file
    with pytest.raises(ConfigError) as info:
        check_gguf_file(str(zipped), "import source")
    assert str(info.value).startswith(
        f"import source {str(zipped)!r} is not a GGUF file (it starts with b'PK\\x03\\x04', not b'GGUF'); give a .gguf"
    )
    (tmp_path / "short.gguf").write_bytes(b"GG")  # shorter than the magic
    with pytest.raises(ConfigError, match=r"it starts with b'GG', not b'GGUF'"):
        check_gguf_file(str(tmp_path / "short.gguf"), "model.path")
    missing = str(tmp_path / "none.gguf")
    with pytest.raises(ConfigError, match=rf"^model\.path '{missing}' does not exist; give a \.gguf file$"):
        check_gguf_file(missing, "model.path")


def loaded(method) -> SimpleNamespace:
    """What from_pretrained returns, as far as strip_quantizer looks: config, quantizer, flag."""
    config = SimpleNamespace(quantization_config=SimpleNamespace(quant_method=method))
    return SimpleNamespace(config=config, hf_quantizer=object(), is_quantized=True)


def test_only_a_gguf_quantisation_record_is_stripped():
    for method in (QuantizationMethod.GGUF, "gguf"):  # transformers' enum, or a plain string
        model = loaded(method)
        assert strip_quantizer(model) is model
        assert not hasattr(model.config, "quantization_config")
        assert model.hf_quantizer is None and model.is_quantized is False
    packed = loaded(QuantizationMethod.BITS_AND_BYTES)  # packed integer weights: kept, training refuses them
    strip_quantizer(packed)
    assert packed.config.quantization_config.quant_method is QuantizationMethod.BITS_AND_BYTES and packed.is_quantized
    plain = SimpleNamespace(config=SimpleNamespace())
    assert strip_quantizer(plain) is plain and vars(plain.config) == {}


def test_a_folder_named_like_a_gguf_file_is_refused_naming_it(tmp_path):
    folder = tmp_path / "x.gguf"
    folder.mkdir()
    with pytest.raises(ConfigError, match=r"'.*x\.gguf' is a folder, not a GGUF file; give the \.gguf file inside it"):
        check_gguf_file(str(folder), "import source")

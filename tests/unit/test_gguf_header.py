"""The GGUF architecture read from a file's header alone: the same answer as gguf's own reader whenever the key
comes before the vocabulary, and no answer (the caller reads the file whole) whenever it cannot be sure."""

from __future__ import annotations

import pytest
from gguf import GGUFReader, GGUFWriter

from speculators_train.engines.llamacpp.serving import leading_string


def write(path, arch_after_vocabulary: bool = False, endianess=None) -> None:
    writer = GGUFWriter(path, "llama", **({"endianess": endianess} if endianess is not None else {}))
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_bool("general.flag", True)
    if arch_after_vocabulary:
        del writer.kv_data[0]["general.architecture"]
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "a", "b"])
    if arch_after_vocabulary:
        writer.add_string("general.architecture", "llama")
    writer.add_string("general.name", "tiny")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()


def whole(path, key: str) -> str:
    field = GGUFReader(path).fields[key]
    return bytes(field.parts[field.data[0]]).decode()


def test_the_header_gives_what_the_whole_file_gives(tmp_path):
    write(tmp_path / "m.gguf")
    assert leading_string(tmp_path / "m.gguf", "general.architecture") == whole(
        tmp_path / "m.gguf", "general.architecture"
    )
    # Past the scalars of every size; a key after the vocabulary is not guessed at.
    assert leading_string(tmp_path / "m.gguf", "general.name") is None
    assert leading_string(tmp_path / "m.gguf", "general.missing") is None


@pytest.mark.parametrize("damage", ["after_vocabulary", "truncated", "big_endian", "not_gguf"])
def test_no_answer_where_the_header_cannot_tell(tmp_path, damage):
    from gguf.constants import GGUFEndian

    path = tmp_path / "m.gguf"
    write(
        path,
        arch_after_vocabulary=damage == "after_vocabulary",
        endianess=GGUFEndian.BIG if damage == "big_endian" else None,
    )
    if damage == "after_vocabulary":
        assert whole(path, "general.architecture") == "llama"
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:40])
    if damage == "not_gguf":
        path.write_bytes(b"PK\x03\x04" + path.read_bytes()[4:])
    assert leading_string(path, "general.architecture") is None


def test_doctor_reads_no_field_of_identical_files_and_names_a_changed_one(tmp_path, monkeypatch):
    from speculators_train.engines.llamacpp import doctor
    from speculators_train.engines.llamacpp.doctor import gguf_diffs

    read = []
    contents = doctor.gguf_contents
    monkeypatch.setattr(doctor, "gguf_contents", lambda path: read.append(path) or contents(path))
    write(tmp_path / "a.gguf")
    write(tmp_path / "b.gguf")
    assert gguf_diffs(tmp_path / "a.gguf", tmp_path / "b.gguf") == [] and read == []
    data = bytearray((tmp_path / "b.gguf").read_bytes())
    at = data.index(b"tiny")
    data[at : at + 4] = b"tinz"  # general.name is skipped by doctor: the bytes differ, llama.cpp reads nothing else
    (tmp_path / "b.gguf").write_bytes(data)
    assert gguf_diffs(tmp_path / "a.gguf", tmp_path / "b.gguf") == [] and len(read) == 2
    writer = GGUFWriter(tmp_path / "c.gguf", "llama")
    writer.add_uint32("llama.block_count", 3)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    diffs = gguf_diffs(tmp_path / "a.gguf", tmp_path / "c.gguf")
    assert "llama.block_count: trained 2, llama.cpp will read 3" in diffs

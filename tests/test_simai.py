"""The SimAI format: writer byte for byte, and a reader that rejects what SimAI silently misreads."""

from __future__ import annotations

import re

import pytest

from inspector.errors import InputError
from inspector.report.simai import (
    COLLECTIVES,
    Header,
    Record,
    parse_compute_profile,
    parse_workload,
    render_workload,
)

HEADER = Header(tp=8, ep=1, pp=16, vpp=1, ga=16, all_gpus=1024, pp_comm=16777216)
HEADER_LINE = (
    "HYBRID_TRANSFORMER_FWD_IN_BCKWD model_parallel_NPU_group: 8 ep: 1 pp: 16 vpp: 1 ga: 16 "
    "all_gpus: 1024 checkpoints: 0 checkpoint_initiates: 0 pp_comm: 16777216"
)
ROW = "attention_row\t-1\t5\tREDUCESCATTER\t134217728\t6\tALLGATHER\t134217728\t7\tNONE\t0\t100"
GOOD = f"{HEADER_LINE}\n1\n{ROW}\n"


def test_writer_is_byte_exact() -> None:
    record = Record("attention_row", 5, "REDUCESCATTER", 134217728, 6, "ALLGATHER", 134217728, 7)
    assert render_workload(HEADER, [record]) == GOOD


def test_reader_reads_back_what_the_writer_writes() -> None:
    records = [
        Record("grad_param_comm", wg_comm="REDUCESCATTER", wg_bytes=10),
        Record("moe_grad_norm2", wg_comm="REDUCESCATTER_DP_EP", wg_bytes=12),
        Record("mlp_moelayer", 1, "ALLTOALL_EP", 3, 2, "ALLTOALL_EP", 3),
    ]
    text = render_workload(HEADER, records)
    assert parse_workload(text) == (HEADER, records)


def test_known_collectives_are_simai_s_twelve() -> None:
    # Workload.cc 1319-1509: four prefixes, each with no suffix, _EP or _DP_EP.
    assert len(COLLECTIVES) == 12
    assert "ALLTOALL_DP_EP" in COLLECTIVES and "BROADCAST" not in COLLECTIVES


def test_pp_1_header_has_pp_comm_0() -> None:
    text = render_workload(Header(1, 1, 1, 1, 1, 1, 0), [])
    assert text.startswith("HYBRID_TRANSFORMER_FWD_IN_BCKWD model_parallel_NPU_group: 1 ")
    assert text.endswith("pp_comm: 0\n0\n")
    assert parse_workload(text)[1] == []


def bad(text: str, message: str) -> None:
    with pytest.raises(InputError, match=message):
        parse_workload(text)


def test_eleven_fields() -> None:
    # SimAI's `>>` would shift every later field by one.
    bad(
        f"{HEADER_LINE}\n1\n{ROW.rsplit(chr(9), 1)[0]}\n",
        "line 3: a record has 12 fields, found 11",
    )


def test_thirteen_fields() -> None:
    bad(f"{HEADER_LINE}\n1\n{ROW}\t1\n", "line 3: a record has 12 fields, found 13")


def test_count_too_high() -> None:
    # SimAI reuses stale values for missing records.
    bad(f"{HEADER_LINE}\n2\n{ROW}\n", "line 2: the count says 2 records, the file holds 1")


def test_count_too_low() -> None:
    # SimAI ignores surplus records.
    bad(f"{HEADER_LINE}\n1\n{ROW}\n{ROW}\n", "the count says 1 records, the file holds 2")


def test_count_not_a_number() -> None:
    bad(f"{HEADER_LINE}\none\n{ROW}\n", "line 2: the record count must be an integer")


@pytest.mark.parametrize(
    "name", ["allgather", "BROADCAST", "ALLREDUCE_TP", "ALLREDUCEALLTOALL", "ALLGATHER_DP"]
)
def test_unknown_collective(name: str) -> None:
    # Lower case, other verbs and other suffixes are silently free in SimAI; ALLREDUCEALLTOALL
    # is caught by the ALLREDUCE prefix first and gets no group (Workload.cc 1319-1329).
    bad(
        f"{HEADER_LINE}\n1\n{ROW.replace('ALLGATHER', name)}\n",
        f"line 3: unknown collective '{name}'",
    )


def test_bytes_without_collective() -> None:
    # A size next to NONE is a generator bug: the collective it meant was dropped.
    row = ROW.replace("ALLGATHER", "NONE")
    bad(f"{HEADER_LINE}\n1\n{row}\n", "line 3: input-grad has no collective but 134217728 bytes")


def test_negative_size() -> None:
    bad(f"{HEADER_LINE}\n1\n{ROW.replace('134217728', '-1', 1)}\n", "line 3: fwd_bytes must lie in")


def test_float_size() -> None:
    # AICB writes pp_comm as 16777216.0; SimAI's std::stoi stops at the dot, other fields fail.
    bad(
        f"{HEADER_LINE}\n1\n{ROW.replace('134217728', '1.5', 1)}\n",
        "forward bytes must be an integer",
    )


def test_dependency_not_minus_one() -> None:
    bad(f"{HEADER_LINE}\n1\n{ROW.replace('-1', '0', 1)}\n", "line 3: field 2 must be -1")


@pytest.mark.parametrize("key", ["vpp:", "ga:", "pp_comm:", "ep:", "all_gpus:"])
def test_header_key_missing(key: str) -> None:
    # A missing key stays uninitialised in SimAI: a missing vpp prints "NaN or Inf".
    tokens = HEADER_LINE.split()
    at = tokens.index(key)
    line = " ".join(tokens[:at] + tokens[at + 2 :])
    bad(f"{line}\n1\n{ROW}\n", f"line 1: header lacks {key}")


def test_header_pp_comm_without_colon() -> None:
    # SimAI's own example/workload_analytical.txt writes `pp_comm 50331648`; SimAI accepts
    # both spellings (Workload.cc 1259) but AICB and this tool write the colon.
    line = HEADER_LINE.replace("pp_comm:", "pp_comm")
    bad(f"{line}\n1\n{ROW}\n", "unknown header key 'pp_comm'")


def test_header_zero_ga() -> None:
    # Workload.cc 1266-1271 warns; the bubble term divides by ga.
    bad(
        f"{HEADER_LINE.replace('ga: 16', 'ga: 0')}\n1\n{ROW}\n", "line 1: header ga must lie in 1.."
    )


def test_header_pp_without_pp_comm() -> None:
    line = HEADER_LINE.replace("pp_comm: 16777216", "pp_comm: 0")
    bad(f"{line}\n1\n{ROW}\n", "pp_comm must be 0 exactly when pp is 1 \\(pp 16, pp_comm 0\\)")


def test_header_pp_comm_without_pp() -> None:
    line = HEADER_LINE.replace("pp: 16", "pp: 1")
    bad(
        f"{line}\n1\n{ROW}\n", "pp_comm must be 0 exactly when pp is 1 \\(pp 1, pp_comm 16777216\\)"
    )


def test_header_pp_comm_beyond_stoi() -> None:
    line = HEADER_LINE.replace("16777216", str(2**31))
    bad(f"{line}\n1\n{ROW}\n", "pp_comm must lie in 0..2147483647")


def test_header_checkpoints() -> None:
    # N > 0 makes SimAI read the same layer N times (Workload.cc 1199-1210).
    bad(
        f"{HEADER_LINE.replace('checkpoints: 0', 'checkpoints: 1')}\n1\n{ROW}\n",
        "checkpoints: must be 0",
    )


def test_header_policy() -> None:
    bad(
        f"{HEADER_LINE.replace('_FWD_IN_BCKWD', '')}\n1\n{ROW}\n",
        "must start with HYBRID_TRANSFORMER_FWD_IN_BCKWD",
    )


def test_header_key_twice() -> None:
    bad(f"{HEADER_LINE} ga: 4\n1\n{ROW}\n", "header key 'ga:' given twice")


def test_no_final_newline() -> None:
    bad(GOOD[:-1], "must end with a newline")


def test_writer_refuses_what_the_reader_refuses() -> None:
    with pytest.raises(InputError, match="unknown collective 'BROADCAST'"):
        render_workload(HEADER, [Record("x", fwd_comm="BROADCAST", fwd_bytes=1)])
    with pytest.raises(InputError, match="header vpp must lie in 1.."):
        render_workload(Header(8, 1, 16, 0, 16, 1024, 1), [])
    with pytest.raises(InputError, match="record name 'a b'"):
        render_workload(HEADER, [Record("a b")])


# Hand-written in the layout AIOB writes (aicb workload/aiob_inputs/Example.txt).
PROFILE = """train_iter:10
Emb:
    time_gpu_max: 857
    time_gpu_min: 782
    time_gpu_avg: 799
atten_qkv:
    time_gpu_max: 1255
    time_gpu_min: 862
    time_gpu_avg: 889.5
param_time:
    time_gpu_max: 23746
    time_gpu_min: 16647
    time_gpu_avg: 17374
"""


def test_compute_profile() -> None:
    assert parse_compute_profile(PROFILE) == {
        "Emb": (799.0, 782.0),
        "atten_qkv": (889.5, 862.0),
        "param_time": (17374.0, 16647.0),
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "holds no section"),
        ("Emb:\n    time_gpu_min: 1\n", "section 'Emb' lacks time_gpu_avg"),
        ("    time_gpu_avg: 1\n", "line 1: a value before any section"),
        ("Emb:\n    time_gpu_avg: fast\n", "line 2: time_gpu_avg must be a number, got 'fast'"),
        ("Emb:\n    time_gpu_avg: -3\n", "line 2: time_gpu_avg must be a number of microseconds from 0 to 1e+12, got -3"),
        ("Emb:\n    time_gpu_avg: inf\n", "line 2: time_gpu_avg must be a number of microseconds from 0 to 1e+12, got inf"),
        ("Emb:\n    time_gpu_avg: nan\n", "line 2: time_gpu_avg must be a number of microseconds from 0 to 1e+12, got nan"),
        ("Emb:\n    time_gpu_avg: 1e300\n", "line 2: time_gpu_avg must be a number of microseconds from 0 to 1e+12, got 1e300"),
        ("Emb: 3\n", "line 1: `Emb:` takes no value"),
        ("just words\n", "line 1: expected `NAME:` or `key: value`"),
    ],
)
def test_compute_profile_malformed(text: str, message: str) -> None:
    with pytest.raises(InputError, match=re.escape(message)):
        parse_compute_profile(text)

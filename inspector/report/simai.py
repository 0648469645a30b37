"""SimAI's workload format: records, the header, a writer and a strict reader.

SimAI (aliyun/SimAI, astra-sim-alibabacloud, HEAD cef83f9d) reads one text file per simulated
rank in `Workload::initialize_workload` (astra-sim/workload/Workload.cc 1136-1551):
  line 1  the parallelism policy, then `key: value` pairs anywhere on the line (1155-1192);
          keys it does not find stay uninitialised, so every key is always written here;
  line 2  the number of records (`std::stoi`, 1283-1285);
  then    that many records of 12 whitespace-separated fields, read with `>>` (1286-1311).
A collective is matched by prefix (ALLREDUCE, ALLTOALL, ALLGATHER, REDUCESCATTER) and its
group by the exact suffix (1319-1509): none = tensor parallel in the forward and input-grad
columns and data parallel in the weight-grad column, `_EP` expert parallel, `_DP_EP` expert
data parallel. Anything else costs nothing, silently. SimAI never reports a malformed file, so
`parse_workload` enforces every rule here, with line numbers, and the writer's output is always
read back by it in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from inspector.errors import ConfigError, InputError

POLICY = "HYBRID_TRANSFORMER_FWD_IN_BCKWD"
NONE = "NONE"
KINDS = ("ALLREDUCE", "ALLGATHER", "REDUCESCATTER", "ALLTOALL")
GROUPS = ("", "_EP", "_DP_EP")  # tensor (or data, in the weight-grad column), expert, expert data
COLLECTIVES = frozenset(kind + group for kind in KINDS for group in GROUPS)
INT_MAX = 2**31 - 1  # header values go through std::stoi (Workload.cc 1180-1260)
UINT64_MAX = 2**64 - 1  # sizes are uint64_t, times are Tick (uint64_t)
FIELDS = 12


@dataclass(frozen=True)
class Record:
    """One line of a SimAI workload: a layer's three phases (times in ns, sizes in bytes).

    Sizes are the whole collective buffer, as AICB writes them; a phase without a collective has
    `NONE` and size 0. `update` is the 12th field (weight-update delay, AICB's constant 100).
    """

    name: str
    fwd_compute: int = 0
    fwd_comm: str = NONE
    fwd_bytes: int = 0
    ig_compute: int = 0
    ig_comm: str = NONE
    ig_bytes: int = 0
    wg_compute: int = 0
    wg_comm: str = NONE
    wg_bytes: int = 0
    update: int = 100
    dependency: int = -1

    def line(self) -> str:
        """Return the record as SimAI reads it: 12 tab-separated fields (AICB's layout)."""
        values = (
            self.name,
            self.dependency,
            self.fwd_compute,
            self.fwd_comm,
            self.fwd_bytes,
            self.ig_compute,
            self.ig_comm,
            self.ig_bytes,
            self.wg_compute,
            self.wg_comm,
            self.wg_bytes,
            self.update,
        )
        return "\t".join(str(v) for v in values)


@dataclass(frozen=True)
class Header:
    """Line 1: every key SimAI reads for the transformer policy (Workload.cc 1175-1260).

    `tp` is written as `model_parallel_NPU_group`; `pp_comm` is the bytes of one pipeline send.
    `checkpoints` and `checkpoint_initiates` are always 0: N > 0 hits a parsing bug (1199-1222).
    """

    tp: int
    ep: int
    pp: int
    vpp: int
    ga: int
    all_gpus: int
    pp_comm: int

    def line(self) -> str:
        """Return the header line in AICB's key order (SimAI_training_workload_generator.py 853-861)."""
        return (
            f"{POLICY} model_parallel_NPU_group: {self.tp} ep: {self.ep} pp: {self.pp} "
            f"vpp: {self.vpp} ga: {self.ga} all_gpus: {self.all_gpus} "
            f"checkpoints: 0 checkpoint_initiates: 0 pp_comm: {self.pp_comm}"
        )


HEADER_KEYS = {
    "model_parallel_NPU_group:": "tp",
    "ep:": "ep",
    "pp:": "pp",
    "vpp:": "vpp",
    "ga:": "ga",
    "all_gpus:": "all_gpus",
    "checkpoints:": "",
    "checkpoint_initiates:": "",
    "pp_comm:": "pp_comm",
}


MAX_RECORDS = 2_000_000  # one stage's file: about 100 MB, a minute to check (docs/limits.md)


def per_microbatch(block: list[Record], microbatches: int) -> list[Record]:
    """Return a micro-batch's records once per micro-batch, as SimAI's file lists them, or raise
    ConfigError past MAX_RECORDS (a billion micro-batches would be a file of terabytes)."""
    if len(block) * microbatches > MAX_RECORDS:
        raise ConfigError(
            f"workload: {microbatches:,} micro-batches x {len(block):,} records each is more than "
            f"the {MAX_RECORDS:,} records a stage's file holds here; SimAI's file lists every "
            "micro-batch: fewer micro-batches (--global-batch-size / (--micro-batch-size x dp)) "
            "answer (docs/limits.md)"
        )
    return block * microbatches


def render_workload(header: Header, records: list[Record]) -> str:
    """Return the file text: header, record count, records, newline at the end."""
    check_header(header, line=1)
    for number, record in enumerate(records, start=3):
        check_record(record, number)
    lines = [header.line(), str(len(records))] + [r.line() for r in records]
    return "\n".join(lines) + "\n"


def check_header(header: Header, line: int) -> None:
    """Raise InputError where SimAI would warn, misread or divide by zero."""
    for name in ("tp", "ep", "pp", "vpp", "ga", "all_gpus"):
        value = getattr(header, name)
        if not 1 <= value <= INT_MAX:
            raise InputError(f"line {line}: header {name} must lie in 1..{INT_MAX}, got {value}")
    if not 0 <= header.pp_comm <= INT_MAX:
        # SimAI reads it with std::stoi into a uint32_t (Workload.cc 1260, Layer.cc 568).
        raise InputError(
            f"line {line}: header pp_comm must lie in 0..{INT_MAX} (std::stoi), got {header.pp_comm}"
        )
    if (header.pp == 1) != (header.pp_comm == 0):
        # Workload.cc 1266-1271 warns "Input workload format mismatch" otherwise.
        raise InputError(
            f"line {line}: header pp_comm must be 0 exactly when pp is 1 "
            f"(pp {header.pp}, pp_comm {header.pp_comm})"
        )


def check_record(record: Record, line: int) -> None:
    """Raise InputError for a record SimAI would misread or silently drop."""
    if not record.name or any(c.isspace() for c in record.name):
        raise InputError(f"line {line}: record name {record.name!r} must be one non-empty word")
    if record.dependency != -1:
        raise InputError(f"line {line}: field 2 must be -1, got {record.dependency}")
    for f in fields(Record):
        value = getattr(record, f.name)
        if f.name in ("fwd_comm", "ig_comm", "wg_comm"):
            if value != NONE and value not in COLLECTIVES:
                raise InputError(
                    f"line {line}: unknown collective {value!r} in {f.name}; SimAI only knows "
                    f"NONE and {'/'.join(KINDS)} with no suffix, _EP or _DP_EP"
                )
        elif isinstance(value, int) and f.name != "dependency" and not 0 <= value <= UINT64_MAX:
            raise InputError(f"line {line}: {f.name} must lie in 0..2^64-1, got {value}")
    for comm, size, column in (
        (record.fwd_comm, record.fwd_bytes, "forward"),
        (record.ig_comm, record.ig_bytes, "input-grad"),
        (record.wg_comm, record.wg_bytes, "weight-grad"),
    ):
        if comm == NONE and size:
            raise InputError(f"line {line}: {column} has no collective but {size} bytes")


def _int(token: str, line: int, what: str) -> int:
    """Return a decimal integer token or raise InputError naming the line."""
    if not token.lstrip("-").isdigit():
        raise InputError(f"line {line}: {what} must be an integer, got {token!r}")
    return int(token)


def parse_header(text: str, line: int = 1) -> Header:
    """Parse and check line 1: the policy, then every key exactly once."""
    tokens = text.split()
    if not tokens or tokens[0] != POLICY:
        raise InputError(f"line {line}: the header must start with {POLICY}")
    values: dict[str, int] = {}
    rest = tokens[1:]
    if len(rest) % 2:
        raise InputError(f"line {line}: the header must be `key: value` pairs")
    for key, value in zip(rest[::2], rest[1::2]):
        if key not in HEADER_KEYS:
            raise InputError(f"line {line}: unknown header key {key!r}")
        if key in values:
            raise InputError(f"line {line}: header key {key!r} given twice")
        values[key] = _int(value, line, key)
    missing = [k for k in HEADER_KEYS if k not in values]
    if missing:
        raise InputError(f"line {line}: header lacks {', '.join(missing)}")
    for key in ("checkpoints:", "checkpoint_initiates:"):
        if values[key] != 0:
            raise InputError(f"line {line}: {key} must be 0 (SimAI misparses N > 0)")
    header = Header(**{name: values[key] for key, name in HEADER_KEYS.items() if name})
    check_header(header, line)
    return header


def parse_record(text: str, line: int) -> Record:
    """Parse one record line: exactly 12 fields."""
    tokens = text.split()
    if len(tokens) != FIELDS:
        raise InputError(f"line {line}: a record has {FIELDS} fields, found {len(tokens)}")
    name, dep, fc, fcomm, fb, ic, icomm, ib, wc, wcomm, wb, up = tokens
    record = Record(
        name=name,
        dependency=_int(dep, line, "field 2"),
        fwd_compute=_int(fc, line, "forward compute"),
        fwd_comm=fcomm,
        fwd_bytes=_int(fb, line, "forward bytes"),
        ig_compute=_int(ic, line, "input-grad compute"),
        ig_comm=icomm,
        ig_bytes=_int(ib, line, "input-grad bytes"),
        wg_compute=_int(wc, line, "weight-grad compute"),
        wg_comm=wcomm,
        wg_bytes=_int(wb, line, "weight-grad bytes"),
        update=_int(up, line, "weight update"),
    )
    check_record(record, line)
    return record


def parse_workload(text: str) -> tuple[Header, list[Record]]:
    """Read a SimAI workload, enforcing every rule SimAI leaves unchecked.

    One record per line (SimAI would accept records spread over lines; a writer never needs
    to), the count line equal to the records that follow, newline-terminated.
    """
    if not text.endswith("\n"):
        raise InputError("the workload must end with a newline")
    lines = text[:-1].split("\n")
    if len(lines) < 2:
        raise InputError("the workload needs a header line and a count line")
    header = parse_header(lines[0])
    count = _int(lines[1].strip(), 2, "the record count")
    records = [parse_record(text, number) for number, text in enumerate(lines[2:], start=3)]
    if count != len(records):
        raise InputError(f"line 2: the count says {count} records, the file holds {len(records)}")
    if count > INT_MAX:
        raise InputError(f"line 2: SimAI reads at most {INT_MAX} records (std::stoi)")
    return header, records


MAX_PROFILE_US = 1e12  # 11.6 days per kernel group; x 1000 in ns stays inside SimAI's int64


def parse_compute_profile(text: str) -> dict[str, tuple[float, float]]:
    """Read AICB/AIOB's compute profile: section -> (time_gpu_avg, time_gpu_min) in µs.

    The format AIOB writes (aicb utils/utils.py `process_all_keys` 450-496, example
    workload/aiob_inputs/Example.txt): an optional `train_iter:N` line, then per measured
    kernel group a `NAME:` line followed by indented `time_gpu_max: X`, `time_gpu_min: X`,
    `time_gpu_avg: X` lines. Times are microseconds (CUDA event milliseconds x 1000,
    `cuda_timing_decorator` 499-512); AICB multiplies them by 1000 into SimAI's nanoseconds.
    """
    sections = _profile_sections(text)
    profile: dict[str, tuple[float, float]] = {}
    for name, values in sections.items():
        if "time_gpu_avg" not in values:
            raise InputError(f"--compute-profile section {name!r} lacks time_gpu_avg")
        profile[name] = (values["time_gpu_avg"], values.get("time_gpu_min", values["time_gpu_avg"]))
    if not profile:
        raise InputError("--compute-profile holds no section")
    return profile


def _profile_sections(text: str) -> dict[str, dict[str, float]]:
    """Return each `NAME:` section's `key: value` numbers, checking every line's shape."""
    sections: dict[str, dict[str, float]] = {}
    current: str | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        key, sep, value = line.partition(":")
        if not sep or not key or any(c.isspace() for c in key):
            raise InputError(f"--compute-profile line {number}: expected `NAME:` or `key: value`")
        if not raw[:1].isspace():  # a section header, or train_iter:N
            if key == "train_iter":
                continue
            if value.strip():
                raise InputError(f"--compute-profile line {number}: `{key}:` takes no value")
            current = key
            sections[current] = {}
            continue
        if current is None:
            raise InputError(f"--compute-profile line {number}: a value before any section")
        try:
            sections[current][key] = float(value)
        except ValueError:
            raise InputError(
                f"--compute-profile line {number}: {key} must be a number, got {value.strip()!r}"
            ) from None
        if not 0 <= sections[current][key] <= MAX_PROFILE_US:  # also nan and inf
            raise InputError(
                f"--compute-profile line {number}: {key} must be a number of microseconds from 0 "
                f"to {MAX_PROFILE_US:.0e}, got {value.strip()}"
            )
    return sections

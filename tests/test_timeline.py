"""`memory --timeline FILE.svg` and `memory --snapshot FILE.pickle`: the engine's iteration drawn
and dumped as torch's memory snapshot, checked against the report's own numbers."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import formulas_only, run_cli

SVG = "{http://www.w3.org/2000/svg}"
JOB = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8"]
JOB += ["--seq-length", "128", "--vocab-size", "1000", "--pp", "2", "--bf16"]
JOB += ["--micro-batch-size", "2", "--global-batch-size", "8", "--use-distributed-optimizer"]
BANDS = ["weights", "gradients", "optimizer", "buffers", "activations", "transient"]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run `memory --timeline --snapshot` twice (byte-identical?) and keep the json report."""
    folder = tmp_path_factory.mktemp("timeline")
    runs = []
    for n in (1, 2):
        svg, snap = folder / f"{n}.svg", folder / f"{n}.pickle"
        result = run_cli("memory", *JOB, "--no-cache", "--format", "json",
                         "--timeline", str(svg), "--snapshot", str(snap))
        assert result.code == 0, result.err
        runs.append((json.loads(result.out), svg.read_bytes(), snap.read_bytes()))
    return {"runs": runs}


def test_svg_is_well_formed_with_one_band_per_category_and_the_reports_peak(outputs) -> None:
    report, svg, _ = outputs["runs"][0]
    root = ET.fromstring(svg)
    panels = root.findall(f"{SVG}g")
    assert [p.get("data-stage") for p in panels] == [str(s["stage"]) for s in report["stages"]]
    for panel, stage in zip(panels, report["stages"], strict=True):
        assert panel.get("data-rank") == str(stage["rank"])
        bands = [p.get("data-band") for p in panel.findall(f"{SVG}path")]
        assert bands == BANDS
        (label,) = [t.text for t in panel.findall(f"{SVG}text") if t.get("class") == "peak"]
        total = f"{stage['total'] / 2**30:.3f}"  # below 1 GiB: three decimals
        assert label == f"peak {total} GiB: {stage['activations']['moment']}"
        (mark,) = panel.findall(f"{SVG}circle")  # the replay's highest point is in that pass
        assert stage["activations"]["moment"].startswith(mark.get("data-pass") + ": ")


def test_svg_static_bands_are_the_reports_bytes(outputs) -> None:
    """The four flat bands' heights, read back from the paths, are the report's state bytes."""
    report, svg, _ = outputs["runs"][0]
    for panel, stage in zip(ET.fromstring(svg).findall(f"{SVG}g"), report["stages"], strict=True):
        ticks = {float(t.text): float(t.get("y")) for t in panel.findall(f"{SVG}text")
                 if t.get("text-anchor") == "end"}
        (low, y0), (high, y1) = min(ticks.items()), max(ticks.items())
        per_gib = (y0 - y1) / (high - low)
        sizes = [stage["weights"], stage["gradients"], stage["optimizer"], stage["buffers"]["total"]]
        for path, size in zip(panel.findall(f"{SVG}path"), sizes, strict=False):
            d = path.get("d")
            bottom, top = _flat(d)
            assert abs((bottom - top) - size / 2**30 * per_gib) <= 0.11  # one decimal each


def _flat(d: str) -> tuple[float, float]:
    """Return the two y values of a flat band's path M x,y0 H x V y1 H x Z."""
    y0 = float(d.split(",")[1].split("H")[0])
    y1 = float(d.split("V")[1].split("H")[0])
    return y0, y1


@pytest.mark.slow
def test_outputs_are_byte_identical_run_to_run(outputs, tmp_path: Path) -> None:
    (_, svg1, snap1), (_, svg2, snap2) = outputs["runs"]
    assert svg1 == svg2 and snap1 == snap2
    # and in another process, with another string hash seed
    svg, snap = tmp_path / "t.svg", tmp_path / "s.pickle"
    command = [sys.executable, "-m", "inspector", "memory", *JOB, "--no-cache",
               "--timeline", str(svg), "--snapshot", str(snap)]
    env = {**os.environ, "PYTHONHASHSEED": "7"}
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    assert svg.read_bytes() == svg1 and snap.read_bytes() == snap1


def _replay(segment: dict[str, Any], trace: list[dict[str, Any]]) -> tuple[int, int, dict[int, int]]:
    """Return the highest and the final allocated bytes (the static blocks, then the trace) and
    the blocks the trace leaves live (address -> size)."""
    now = sum(b["size"] for b in segment["blocks"] if b["state"] == "active_allocated")
    high = now
    live: dict[int, int] = {}
    for entry in trace:
        if entry["action"] == "alloc":
            assert entry["addr"] not in live, "two live blocks at one address"
            assert not any(a < entry["addr"] + entry["size"] and entry["addr"] < a + s
                           for a, s in live.items()), "overlapping live blocks"
            live[entry["addr"]] = entry["size"]
            now += entry["size"]
        elif entry["action"] == "free_completed":
            assert live.pop(entry["addr"]) == entry["size"]
            now -= entry["size"]
        high = max(high, now)
    return high, now, live


def test_snapshot_round_trips_and_its_max_allocated_is_the_reported_peak(outputs) -> None:
    report, _, snap = outputs["runs"][0]
    data = pickle.loads(snap)
    assert set(data) == {"segments", "device_traces"}
    assert len(data["device_traces"]) == len(report["stages"])
    for device, stage in enumerate(report["stages"]):
        (segment,) = [s for s in data["segments"] if s["device"] == device]
        trace = data["device_traces"][device]
        assert {e["action"] for e in trace} == {"alloc", "free_requested", "free_completed"}
        high, end, live = _replay(segment, trace)
        assert not live
        assert high == stage["total"]  # to the byte
        assert end == stage["static"]  # every activation freed by the iteration's end
        assert max(e["addr"] + e["size"] for e in trace) <= segment["address"] + segment["total_size"]


def test_torchs_memory_viz_reads_the_snapshot(outputs) -> None:
    """The parts of torch/cuda/_memory_viz.py that run without CUDA accept it."""
    from torch.cuda import _memory_viz as viz

    report, _, snap = outputs["runs"][0]
    data = pickle.loads(snap)
    summary = viz.segsum(data)  # asserts its own accounting: blocks fill each segment
    static = sum(s["static"] for s in report["stages"])
    assert f"total_allocated: {viz.Bytes(static)}" in summary
    assert "Device 1 ----" in viz.trace(data)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):  # it prints every free without its alloc
        paired = viz.filter_alloc_free_pairs(pickle.loads(snap))
    assert said.getvalue() == "" and paired["device_traces"] == [[], []]
    lines = viz.memory(data, format_flamegraph=lambda text: text).splitlines()
    assert "stream_0;active_allocated;megatron-core:0:weights " in "\n".join(lines)
    assert "snapshot.pickle" in viz.trace_plot(data)


def test_a_formula_job_is_refused_and_nothing_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from inspector.memory.engine import run as engine

    svg, snap = tmp_path / "t.svg", tmp_path / "s.pickle"
    flags = ["--timeline", str(svg), "--snapshot", str(snap), "--no-cache"]
    with monkeypatch.context() as patch:  # a job the engine cannot run (none today: made up)
        patch.setattr(engine, "engine_gap", lambda job: "Some layer is not run")
        result = run_cli("memory", *JOB, *flags)
    assert result.code == 2 and result.out == ""
    (line,) = result.err.splitlines()
    assert line.startswith("Error: --timeline and --snapshot need megatron's run of the job")
    with formulas_only():  # the engine's one entry answers "not run": refused after the build
        result = run_cli("memory", *JOB, "--timeline", str(svg), "--no-cache")
    assert result.code == 2 and "Error: --timeline needs megatron's run" in result.err
    assert "not run in this test" in result.err
    assert list(tmp_path.iterdir()) == []


def test_a_folder_is_refused_before_the_build(tmp_path: Path) -> None:
    result = run_cli("memory", *JOB, "--snapshot", str(tmp_path))
    assert result.code == 2 and result.err.startswith("Error: --snapshot ")


def _trace(forward: list[int], backward: list[int]) -> Any:
    """Return a Trace of these allocation sizes (negative: frees), totals counted as the engine does."""
    from inspector.memory.engine.allocator import Event
    from inspector.memory.engine.microbatch import Trace

    events, total = [], 0
    for phase in (forward, backward):
        out = []
        for n, size in enumerate(phase):
            total += size
            out.append(Event(size, total, f"step {n}"))
        events.append(tuple(out))
    return Trace(events[0], events[1], ())


@pytest.mark.parametrize("pp, stage, m, chunks", [(1, 0, 3, 1), (2, 0, 4, 1), (4, 1, 8, 1),
                                                 (4, 3, 8, 1), (2, 0, 4, 2), (2, 1, 6, 3)])
def test_the_timelines_highest_point_is_the_schedules_peak(pp, stage, m, chunks) -> None:
    """memory/engine/timeline.py replays what schedule.py's iteration_peak reduces: same highest point,
    in the pass the peak's moment names; every micro-batch's activations freed at the end."""
    from inspector.memory.engine.schedule import iteration_peak
    from inspector.memory.engine.timeline import Replay

    traces = tuple(_trace([512 * (c + 1), 1024, -1024, 2048], [4096, -4096, -2048, -512 * (c + 1)])
                   for c in range(chunks))
    replay = Replay(traces, stage, pp, m, phases=(("optimizer step", _trace([8192, -8192], []).forward),))
    passes = replay.passes()
    assert len(passes) == replay.count == 2 * m * chunks + 1
    peak = iteration_peak(traces, stage, pp, m)
    highest = max(p.held + a for p in passes[:-1] for _, a, _ in p.steps)
    assert highest == peak.bytes
    first = next(p for p in passes if any(p.held + a == highest for _, a, _ in p.steps))
    assert peak.moment.startswith(first.label + ": ")
    step = passes[-1]
    assert (step.label, step.owner, step.held) == ("optimizer step", (-1, 0), 0)
    assert sorted(p.owner for p in passes[:-1]) == sorted(
        (c, mb) for c in range(chunks) for mb in range(m) for _ in "fb")


def test_past_the_caps_is_refused_and_nothing_written(tmp_path: Path, monkeypatch) -> None:
    from inspector.report import memory_outputs as memory

    svg, snap = tmp_path / "t.svg", tmp_path / "s.pickle"
    monkeypatch.setattr(memory, "MAX_PASSES", 8)  # the stages run 2 x 4 passes and the step
    result = run_cli("memory", *JOB, "--no-cache", "--timeline", str(svg), "--snapshot", str(snap))
    assert result.code == 2 and result.out == ""
    assert result.err == ("Error: --timeline and --snapshot: stage 0 runs 9 passes in an iteration "
                          "(a forward and a backward per micro-batch and chunk, the optimizer step), "
                          "past the 8 one file draws\n")
    monkeypatch.setattr(memory, "MAX_PASSES", 9)
    monkeypatch.setattr(memory, "MAX_SNAPSHOT_ENTRIES", 10)
    result = run_cli("memory", *JOB, "--no-cache", "--timeline", str(svg), "--snapshot", str(snap))
    assert result.code == 2 and result.err.startswith("Error: --snapshot: stage 0's iteration makes")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("pp, stage, chunks", [(4, 0, 1), (4, 3, 1), (4, 0, 2), (4, 2, 3)])
def test_many_micro_batches_peak_as_four_groups(monkeypatch, pp, stage, chunks) -> None:
    """Past engine.schedule.REPLAYED micro-batches the replay stops at 4 groups: the same peak
    and held bytes as replaying every one (a billion-sequence plan stays bounded in time)."""
    from inspector.memory.engine import schedule

    traces = tuple(_trace([512 * (c + 1), 1024, -1024, 2048], [4096, -4096, -2048, -512 * (c + 1)])
                   for c in range(chunks))
    m = 12 * pp  # above the cap set below
    monkeypatch.setattr(schedule, "REPLAYED", 10 * pp)
    short = schedule.iteration_peak(traces, stage, pp, m)
    monkeypatch.setattr(schedule, "REPLAYED", 10**9)
    whole = schedule.iteration_peak(traces, stage, pp, m)
    assert (short.bytes, short.held, short.micro_batches) == (whole.bytes, whole.held, whole.micro_batches)


def test_snapshot_pickles_equal_content_alike_however_its_names_were_made() -> None:
    """pickle stores a string once per object: equal names made apart (a chunk composed from
    small traces, or run whole) must still give the same bytes."""
    from inspector.records import MemoryPass
    from inspector.render.snapshot import _trace

    shared = "layer 3 mlp"
    made = ["".join(["layer 3 ", word]) for word in ("mlp", "mlp")]
    assert made[0] is not made[1] and made[0] == shared

    def passes(first: str, second: str) -> list[MemoryPass]:
        return [MemoryPass("forward of micro-batch 0", (0, 0), 0, ((512, 512, first),)),
                MemoryPass("backward of micro-batch 0", (0, 0), 0, ((512, 1024, second),))]

    pickled = [pickle.dumps(_trace(passes(*names), 0), protocol=4)
               for names in ((shared, shared), tuple(made))]  # fmt: skip
    assert pickled[0] == pickled[1]


def test_an_moe_jobs_snapshot_frees_what_the_iteration_before_left_its_layers(tmp_path: Path) -> None:
    """An MoE layer's dispatcher keeps its last routing probabilities (with their graph) from its
    backward to its next forward (memory/engine/schedule.py `freeing`): the iteration before left
    them, so the trace allocates them first, the first forward frees them and the last backward
    leaves them again; the replay still peaks at the report's peak and ends at its static bytes
    (the snapshot raised "a free ... with no live block" before)."""
    snap = tmp_path / "moe.pickle"
    moe = [*JOB, "--num-experts", "4", "--moe-router-topk", "2", "--ep", "2", "--dp", "2", "--swiglu",
           "--disable-bias-linear", "--moe-grouped-gemm"]
    result = run_cli("memory", *moe, "--no-cache", "--format", "json", "--snapshot", str(snap))
    assert result.code == 0, result.err
    data, report = pickle.loads(snap.read_bytes()), json.loads(result.out)
    for device, stage in enumerate(report["stages"]):
        (segment,) = [s for s in data["segments"] if s["device"] == device]
        trace = data["device_traces"][device]
        first = [e for e in trace if e["frames"][-1]["name"] == "the iteration before"]
        assert first and trace[:len(first)] == first and all(e["action"] == "alloc" for e in first)
        high, end, live = _replay(segment, trace)
        assert (high, end) == (stage["total"], stage["static"])  # to the byte
        assert sum(live.values()) == sum(e["size"] for e in first)  # left again for the next

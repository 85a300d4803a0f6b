"""Pure tier for the planner's hardware profiles (hpctrain/planner/hardware.py): every profile complete and
positive, the dense peaks equal to the trainer's MFU table (hpctrain.train.metrics.DATASHEET_TFLOPS), the profile and
override errors, and link bandwidths read from `hpctrain bench` results written the way benchjob writes them,
including the refusal of malformed files. Importing without torch: tests/multiproc/planner/test_planner_no_torch.py.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/pure/planner/test_planner_hardware.py
"""
from __future__ import annotations

import json
import math

import pytest

from helpers.launch import REPO
from hpctrain.bench.sweep import Row, bandwidths
from hpctrain.planner import hardware
from hpctrain.planner.hardware import DTYPES, OVERRIDABLE, PROFILES, bandwidths_from_bench, profile

NAMES = ["a100-40g", "a100-80g", "h100-sxm", "h100-pcie", "h100-96g-500w", "h200", "b200", "mi250x", "mi300x"]
GPUS = NAMES
# profile -> the DATASHEET_TFLOPS part with the same silicon and clocks
SAME_PART = {"a100-40g": "NVIDIA A100 SXM", "a100-80g": "NVIDIA A100 SXM", "h100-sxm": "NVIDIA H100 SXM",
             "h100-pcie": "NVIDIA H100 PCIe", "h100-96g-500w": "NVIDIA H100 SXM", "h200": "NVIDIA H200",
             "b200": "NVIDIA B200",
             "mi250x": "AMD Instinct MI250X", "mi300x": "AMD Instinct MI300X"}


def test_exactly_the_issue_profiles():
    assert list(PROFILES) == NAMES
    assert all(PROFILES[n].name == n for n in NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_profile_complete_and_positive(name):
    hw = PROFILES[name]
    assert hw.peak_tflops and set(hw.peak_tflops) <= set(DTYPES)
    for value in [*hw.peak_tflops.values(), hw.memory_gib, hw.intra_node_gbps, hw.inter_node_gbps]:
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0
    assert isinstance(hw.gpus_per_node, int) and hw.gpus_per_node > 0
    assert hw.source.strip()
    assert hw.peak("fp32") == hw.peak_tflops["fp32"]  # every part has plain FP32
    assert hw.intra_node_gbps >= hw.inter_node_gbps  # the node's fabric is never slower than its network
    assert not hw.measured and hw.efficiency is None and hw.host_block_s is None  # datasheet figures only


@pytest.mark.parametrize("name", GPUS)
def test_gpu_tensor_peaks_above_fp32(name):
    hw = PROFILES[name]
    assert hw.peak("bf16") > hw.peak("fp32") and hw.peak("fp16") == hw.peak("bf16")
    if "tf32" in hw.peak_tflops:
        assert hw.peak("fp32") < hw.peak("tf32") < hw.peak("bf16")
    if "fp8" in hw.peak_tflops:
        assert hw.peak("fp8") == pytest.approx(2 * hw.peak("bf16"), rel=1e-3)  # datasheets round
    assert hw.gpus_per_node == 8


def test_one_datasheet_table_for_planner_and_trainer():
    """The profiles' peaks and the trainer's MFU read the same table object (no copy to drift)."""
    from hpctrain.train import metrics  # imports torch: only here, never in the planner
    assert metrics.DATASHEET_TFLOPS is hardware.DATASHEET_TFLOPS
    assert set(SAME_PART.values()) == set(hardware.DATASHEET_TFLOPS)  # every part of the table has a profile
    for name, part in SAME_PART.items():
        assert dict(PROFILES[name].peak_tflops) == hardware.DATASHEET_TFLOPS[part], name




def test_documented_figures():
    """The figures the report and the comments state (dense: sparse datasheet figures halved)."""
    assert PROFILES["h100-pcie"].peak("bf16") == 756.5 and PROFILES["h100-pcie"].peak("fp32") == 51.0
    assert PROFILES["h100-sxm"].intra_node_gbps == 450 and PROFILES["h100-sxm"].inter_node_gbps == 50
    assert PROFILES["a100-40g"].memory_gib == 40 and PROFILES["a100-40g"].inter_node_gbps == 25
    assert PROFILES["mi250x"].peak("bf16") == 383.0 / 2 and "tf32" not in PROFILES["mi250x"].peak_tflops


# The figures the source comment in hardware.py cites, as the sources give them (sparse figures halved, package
# figures halved per GCD, NVLink/xGMI totals halved per direction, Gb/s NICs / 8): a change must also change the
# citation. (memory GB, intra GB/s, inter GB/s, fp32, bf16, fp8 or None)
CITED = {
    "a100-40g": (40, 600 / 2, 200 / 8, 19.5, 312.0, None),
    "a100-80g": (80, 600 / 2, 200 / 8, 19.5, 312.0, None),
    "h100-sxm": (80, 900 / 2, 400 / 8, 67.0, 1979 / 2, 3958 / 2),
    "h100-pcie": (80, 128 / 2, 400 / 8, 51.0, 1513 / 2, 3026 / 2),
    "h100-96g-500w": (96, 900 / 2, 400 / 8, 67.0, 1979 / 2, 3958 / 2),  # SXM peaks: an upper bound
    "h200": (1128 / 8, 900 / 2, 400 / 8, 67.0, 1979 / 2, 3958 / 2),
    "b200": (180, 1800 / 2, 400 / 8, 75.0, 4500 / 2, 9000 / 2),
    "mi250x": (128 / 2, 50, 200 / 8 / 2, 95.7 / 2, 383.0 / 2, None),
    "mi300x": (192, 7 * 128 / 2, 400 / 8, 163.4, 1307.4, 2614.9),
}


@pytest.mark.parametrize("name", GPUS)
def test_figures_match_cited_sources(name):
    memory, intra, inter, fp32, bf16, fp8 = CITED[name]
    hw = PROFILES[name]
    assert (hw.memory_gib, hw.intra_node_gbps, hw.inter_node_gbps) == pytest.approx((memory, intra, inter))
    assert (hw.peak("fp32"), hw.peak("bf16")) == pytest.approx((fp32, bf16))
    assert "fp8" not in hw.peak_tflops if fp8 is None else hw.peak("fp8") == pytest.approx(fp8)


def test_cpu_has_no_built_in_figures():
    """A CPU has no datasheet: asking for the cpu profile says how to calibrate instead of using our machine's."""
    with pytest.raises(ValueError, match=r"'cpu': a CPU has no datasheet figures: calibrate .*--calibrate"):
        profile("cpu")


def test_peak_error_names_part_and_dtypes():
    with pytest.raises(ValueError, match=r"mi250x has no 'tf32' peak; it has fp32, bf16, fp16"):
        PROFILES["mi250x"].peak("tf32")


def test_unknown_profile_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown hardware profile 'h100'; valid: a100-40g, .*mi300x"):
        profile("h100")


def test_overrides_apply_to_a_copy():
    hw = profile("a100-80g", {"inter_node_gbps": 12.5, "peak_bf16": 250, "peak_fp8": 500, "gpus_per_node": 4})
    assert (hw.inter_node_gbps, hw.peak("bf16"), hw.peak("fp8"), hw.gpus_per_node) == (12.5, 250.0, 500.0, 4)
    assert hw.peak("fp32") == 19.5 and hw.memory_gib == 80 and hw.name == "a100-80g"
    assert "overridden: inter_node_gbps=12.5, peak_bf16=250" in hw.source
    base = PROFILES["a100-80g"]
    assert (base.inter_node_gbps, base.peak("bf16"), base.gpus_per_node) == (25, 312.0, 8)
    assert "fp8" not in base.peak_tflops and "fp8" not in PROFILES["a100-40g"].peak_tflops  # shared dict untouched
    assert profile("h200") is PROFILES["h200"] and profile("h200", {}) is PROFILES["h200"]
    assert PROFILES["h200"].with_overrides(memory_gib=96).memory_gib == 96


def test_profiles_are_read_only():
    with pytest.raises(TypeError):
        PROFILES["h100-sxm"].peak_tflops["bf16"] = 1.0  # type: ignore[index]
    with pytest.raises(AttributeError):
        PROFILES["h100-sxm"].memory_gib = 1  # type: ignore[misc]


def test_unknown_override_named_with_valid_keys():
    with pytest.raises(ValueError, match=r"unknown override\(s\) 'memory_GB'; valid: memory_gib, .*peak_fp8"):
        profile("h100-sxm", {"memory_GB": 80})
    with pytest.raises(ValueError, match=r"unknown override\(s\) 'peak_int8'"):
        profile("h100-sxm", {"peak_int8": 1.0})
    assert "name" not in OVERRIDABLE and "source" not in OVERRIDABLE


@pytest.mark.parametrize("key, value", [
    ("memory_gib", -80), ("memory_gib", 0), ("intra_node_gbps", math.nan), ("inter_node_gbps", math.inf),
    ("peak_bf16", "989"), ("peak_bf16", True), ("peak_fp32", None), ("gpus_per_node", 4.5), ("gpus_per_node", 0),
])
def test_override_values_must_be_positive_numbers(key, value):
    with pytest.raises(ValueError, match=rf"h100-sxm: override {key}={value!r} must be a positive"):
        profile("h100-sxm", {key: value})


def test_overrides_must_be_a_table():
    with pytest.raises(ValueError, match=r"overrides for b200 must be a table of named figures, not \[\("):
        profile("b200", [("memory_gib", 1)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"overrides for b200 must be a table of named figures, not \{1: 2\}"):
        profile("b200", {1: 2})  # type: ignore[dict-item]


def test_invalid_profile_refused_at_construction():
    with pytest.raises(ValueError, match=r"x: peak_tflops needs .*\(got int4=1\.0\)"):
        hardware.Hardware("x", {"int4": 1.0}, 1, 1, 1, 1, "test")
    with pytest.raises(ValueError, match=r"x: intra_node_gbps=-1 must be a positive"):
        hardware.Hardware("x", {"fp32": 1.0}, 1, -1, 1, 1, "test")


# --- bandwidths from `hpctrain bench` results ---

def bench_row(coll: str, size: int, group: str, time_us: float, nranks: int = 8, backend: str = "torch") -> Row:
    """One measured row as harness.run_benchmark builds it (torch has only the in-place all_reduce)."""
    algbw, busbw = bandwidths(size, time_us / 1e6, coll, nranks)
    res = {"time_us": time_us, "algbw": algbw, "busbw": busbw, "wrong": 0}
    out = res if backend == "mpi" or coll != "all_reduce" else None
    return Row(coll=coll, size=size, count=size // 4, dtype="float", op="sum", root=0, nranks=nranks, group=group,
               backend=backend, algo="flat", out=out, inp=res)


def write_bench(path, rows: list[Row]):
    """Exactly benchjob.run_collectives' writer of bench.jsonl (and of the -J copy)."""
    data = [r.to_json() for r in rows]
    path.write_text("".join(json.dumps(d) + "\n" for d in data))
    return path


MIB = 1 << 20


def test_bandwidths_from_intra_and_inter_runs(tmp_path):
    intra = [bench_row("all_reduce", MIB, "intra", 10.0),  # small size, higher busbw: not the largest size
             bench_row("all_reduce", 256 * MIB, "intra", 1500.0),
             bench_row("all_gather", 512 * MIB, "intra", 100.0)]  # another collective: ignored
    inter = [bench_row("all_reduce", 64 * MIB, "inter", 4000.0, nranks=4),
             bench_row("all_reduce", 512 * MIB, "inter", 1.0, nranks=4, backend="mpi")]  # MPI host buffers: ignored
    path = write_bench(tmp_path / "both.jsonl", intra + inter)  # two runs' files concatenated
    got = bandwidths_from_bench(path)
    assert got == pytest.approx({"intra_node_gbps": 256 * MIB / 1500e-6 / 1e9 * 2 * 7 / 8,
                                 "inter_node_gbps": 64 * MIB / 4000e-6 / 1e9 * 2 * 3 / 4})
    hw = profile("h100-sxm", got)  # the result is a valid set of overrides
    assert hw.intra_node_gbps == got["intra_node_gbps"] and hw.inter_node_gbps == got["inter_node_gbps"]


def test_bandwidths_only_what_was_measured(tmp_path):
    path = write_bench(tmp_path / "bench.jsonl", [bench_row("all_reduce", 16 * MIB, "intra", 200.0)])
    assert list(bandwidths_from_bench(path)) == ["intra_node_gbps"]


def test_world_group_only_when_one_node(tmp_path):
    path = write_bench(tmp_path / "bench.jsonl", [bench_row("all_reduce", 16 * MIB, "world", 200.0),
                                                  bench_row("all_reduce", 16 * MIB, "tp", 100.0)])
    with pytest.raises(ValueError, match=r"bench.jsonl: no torch all_reduce result on the intra or inter group "
                                         r"\(groups found: tp, world\)"):
        bandwidths_from_bench(path)
    got = bandwidths_from_bench(path, world_is_one_node=True)
    assert got == pytest.approx({"intra_node_gbps": 16 * MIB / 200e-6 / 1e9 * 2 * 7 / 8})


def good_line() -> dict:
    return bench_row("all_reduce", 16 * MIB, "intra", 200.0).to_json()


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("group"), r"line 2: key 'group' is missing"),
    (lambda d: d.pop("ip_busbw"), r"line 2: key 'ip_busbw' is missing"),
    (lambda d: d.update(size="16M"), r"line 2: key 'size' is '16M', not a positive whole number"),
    (lambda d: d.update(size=True), r"line 2: key 'size' is True"),
    (lambda d: d.update(coll=["all_reduce"]), r"line 2: key 'coll' is \['all_reduce'\], not a string"),
    (lambda d: d.update(ip_busbw=-3.0), r"line 2: key 'ip_busbw' is -3.0, not a positive finite number"),
    (lambda d: d.update(ip_busbw=math.nan), r"line 2: key 'ip_busbw' is nan"),
    (lambda d: d.update(oop_busbw=math.inf), r"line 2: key 'oop_busbw' is inf"),
    (lambda d: d.update(ip_busbw="48.1"), r"line 2: key 'ip_busbw' is '48.1'"),
    (lambda d: d.update(ip_busbw=None), r"line 2: keys 'ip_busbw' and 'oop_busbw' are both null"),
])
def test_malformed_rows_refused(tmp_path, change, message):
    bad = good_line()
    change(bad)
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good_line()) + "\n" + json.dumps(bad) + "\n")  # json.dumps writes NaN as NaN
    with pytest.raises(ValueError, match=rf"bad\.jsonl: {message}"):
        bandwidths_from_bench(path)


@pytest.mark.parametrize("text, message", [
    ('{"coll": "all_reduce", ', r"line 1 is not JSON"),
    ("[" * 100_000, r"line 1 is not JSON .*nested more than"),
    ('{"coll": "\\ud800"}', r"line 1 is not JSON .*lone surrogate"),
    ("[1, 2, 3]\n", r"line 1 is a list, not a result row"),
    ("\n\n", r"no torch all_reduce result .*\(groups found: none\)"),
])
def test_malformed_files_refused(tmp_path, text, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"bad\.jsonl: {message}"):
        bandwidths_from_bench(path)


def test_oversized_file_refused(tmp_path, monkeypatch):
    path = write_bench(tmp_path / "big.jsonl", [bench_row("all_reduce", MIB, "intra", 10.0)])
    monkeypatch.setattr(hardware, "MAX_BENCH_BYTES", 16)
    with pytest.raises(ValueError, match=r"big\.jsonl: \d+ bytes is too large"):
        bandwidths_from_bench(path)


# --- the CLI: `hpctrain plan --hw KEY=VALUE --bench FILE` ---

def test_parse_figures_names_the_bad_item():
    assert hardware.parse_figures(["peak_bf16=700", " gpus_per_node=4"]) == {"peak_bf16": 700.0, "gpus_per_node": 4}
    for item, fragment in (("inter_gbps=25", "KEY one of memory_gib"), ("inter_node_gbps", "KEY=VALUE"),
                           ("inter_node_gbps=fast", "'fast' is not a number"), ("gpus_per_node=2.5", "not a number")):
        with pytest.raises(ValueError, match=f"--hw {item!r}"):
            hardware.parse_figures([item])
        with pytest.raises(ValueError, match=fragment):
            hardware.parse_figures([item])


def test_plan_cli_takes_figures_and_bench_links(tmp_path):
    from click.testing import CliRunner

    from hpctrain.cli.main import main as cli
    config = str(REPO / "slurm/examples/llama-70b.toml")

    def plan(*args):
        out = CliRunner().invoke(cli, ["plan", config, "--gpu", "h100-sxm", "--json", *args])
        return out.exit_code, (json.loads(out.output) if out.exit_code == 0 else out.output)

    _, base = plan()
    path = write_bench(tmp_path / "bench.jsonl", [bench_row("all_reduce", 256 * MIB, "inter", 40000.0, nranks=16)])
    slow = bandwidths_from_bench(path)["inter_node_gbps"]  # about 20 GB/s, 40% of the datasheet NIC
    _, measured = plan("--bench", str(path))
    assert measured["time_basis"]["dp_link_gbps"] == pytest.approx(slow, rel=1e-3)  # tp 8 fills the node: dp on the NIC
    assert measured["step_time_s"] > base["step_time_s"]
    _, both = plan("--bench", str(path), "--hw", "inter_node_gbps=100")  # --hw wins over --bench
    assert both["time_basis"]["dp_link_gbps"] == 100
    _, half = plan("--hw", f"peak_bf16={profile('h100-sxm').peak('bf16') / 2}")
    flops = {k: d["time_terms"]["compute_s"] - d["time_basis"]["gemm_memory_s"] for k, d in (("base", base),
                                                                                            ("half", half))}
    assert flops["half"] == pytest.approx(2 * flops["base"])  # the FLOPs' part: narrow matmuls are memory's
    code, text = plan("--hw", "memory_gib=-1")
    assert code == 2 and "memory_gib=-1.0 must be a positive finite number" in text


def test_float8_peak_is_the_rate_of_the_mix() -> None:
    """A float8 run's FLOPs split between float8 matmuls (the blocks' linears) and bf16 ones: the mix's peak is the
    rate at which the whole takes as long as its parts (a quarter at fp8 and three quarters at bf16 on an H100 SXM:
    0.25 / 1979 + 0.75 / 989.5 per TFLOP)."""
    hw = profile("h100-sxm")
    assert hw.float8_peak(1.0) == pytest.approx(hw.peak("fp8")) and hw.float8_peak(0.0) == pytest.approx(
        hw.peak("bf16"))
    assert hw.float8_peak(0.25) == pytest.approx(1 / (0.25 / 1979 + 0.75 / 989.5), rel=1e-3)
    with pytest.raises(ValueError, match="float8 share of the FLOPs 1.5"):
        hw.float8_peak(1.5)
    with pytest.raises(ValueError, match="no 'fp8' peak"):
        profile("a100-80g").float8_peak(0.5)

"""Hardware profiles for the planner: the figures its compute term divides FLOPs by (dense matmul peak per dtype),
the memory a layout must fit in (HBM per GPU), and the two links its communication terms run on: the intra-node
fabric (NVLink/xGMI) that tensor parallelism uses and the per-GPU inter-node network (InfiniBand/RoCE) that data
parallelism and FSDP cross.

GPU figures are vendor datasheet values, dense (a figure a datasheet gives only "with sparsity" is halved here);
links are the per-direction bandwidth one GPU sees, which is what a ring collective's bus bandwidth approaches.
They are ceilings, not achievable rates: the planner applies its own efficiency factors. A CPU has no datasheet:
its figures come from a calibration the user runs on the machine itself (`hpctrain plan --calibrate -o FILE`,
hpctrain/train/calibrate.py), a profile file read back by load_profile and named by job.hw_profile. Anything can
be changed per run:

    hw = profile("h100-sxm", {"inter_node_gbps": 25, "peak_bf16": 800})   # overrides, validated
    hw = profile("h100-sxm", bandwidths_from_bench("run/bench.jsonl"))     # links measured by `hpctrain bench`
    hw = load_profile("cpu.json")                                           # a calibration of this machine
    hw.peak("bf16")                                                         # TFLOP/s per GPU

Pure: imports nothing of hpctrain and no torch.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from hpctrain.untrusted import Untrusted, parse_json, read_bytes

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")  # "fp32": plain FP32 (no TF32); the others on tensor/matrix cores
NUMBERS = ("memory_gib", "intra_node_gbps", "inter_node_gbps", "gpus_per_node")
LINKS = ("intra_node_gbps", "inter_node_gbps")  # unknown (None) on a calibration made without `hpctrain bench`
# what a calibration measures besides the peak (hpctrain/train/calibrate.py); None: not calibrated
CALIBRATED = ("efficiency", "host_block_s", "host_tp_block_s", "host_step_s", "host_tp_token_s")
OPTIONAL = ("host_link_gbps", "host_memory_gbps", "hbm_gbps")  # figures a profile may lack (None)
OVERRIDABLE = NUMBERS + tuple(f"peak_{d}" for d in DTYPES) + CALIBRATED + OPTIONAL
CPU = "cpu"  # the name a CPU job's profile goes by: there is no datasheet for it, only a calibration


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: Mapping[str, float]  # dense TFLOP/s per GPU, per matmul input dtype (DTYPES); absent: not offered
    memory_gib: float  # HBM per GPU in GiB: the vendor's "80 GB" (A100, H100) is 80 GiB, 85.9e9 bytes
    intra_node_gbps: float | None  # per GPU, per direction, inside a node (GB/s); None: unknown (calibrations)
    inter_node_gbps: float | None  # per GPU, per direction, between nodes (GB/s); None: unknown (calibrations)
    gpus_per_node: int  # GPUs, or a CPU's cores (one rank per core)
    source: str  # where the figures come from
    measured: bool = False  # figures measured on a machine (a calibration) rather than taken from datasheets
    # A calibration's figures for the time model (planner/timing.estimate); None on datasheet profiles, whose
    # efficiency is timing.EFFICIENCY and whose host work overlaps the kernels. efficiency: the share of the measured
    # GEMM rate a training step's compute reaches; host_*_s: seconds of the host's own work per block and
    # micro-batch (plain, and under tensor parallel) and per step.
    efficiency: float | None = None
    host_block_s: float | None = None
    host_tp_block_s: float | None = None
    host_step_s: float | None = None
    # under tensor parallel, seconds per token, per unit of a rank's model width (dim / tp) and per block, that grow
    # with the activations beyond what the links' bandwidth takes (the redistributions' copies, the collectives'
    # slower rate at an activation's size than at the link's): measured with several ranks (--ranks), None else
    host_tp_token_s: float | None = None
    # per GPU, per direction, between the GPU and host memory (GB/s: PCIe); what CPU offload moves over it
    host_link_gbps: float | None = None
    # per node, the host memory's bandwidth (GB/s) that an offloaded AdamW step streams through; no datasheet has
    # it (a node property): None unless given (--hw host_memory_gbps=...), and the host step is then not timed
    host_memory_gbps: float | None = None
    # the GPU memory's bandwidth (GB/s, datasheet): a GEMM too narrow to reach the compute rate (its bytes take
    # longer at this rate than its FLOPs at the achievable peak) runs at it instead; None (CPU calibrations: this
    # CPU's GEMM rate measured no shape effect down to 1024 x 64 x 128): not modelled
    hbm_gbps: float | None = None
    # a CPU calibration made with several ranks at once (`hpctrain plan --calibrate --ranks N`): every figure is one
    # rank's, measured while N ranks shared the host (the GEMM rate with all of them probing, the links between
    # them); None: one rank with every thread, the host's whole figures (planner/report.time_estimate shares them)
    ranks_per_host: int | None = None

    def __post_init__(self) -> None:
        peaks = dict(self.peak_tflops)
        bad = [f"{d}={v!r}" for d, v in peaks.items() if d not in DTYPES or not _positive(v)]
        if not peaks or bad:
            raise ValueError(f"{self.name}: peak_tflops needs positive numbers for dtypes among {', '.join(DTYPES)}"
                             f" (got {', '.join(bad) or 'none'})")
        for key in NUMBERS:
            if key in LINKS and self.measured and getattr(self, key) is None:
                continue
            if not _positive(getattr(self, key)):
                raise ValueError(f"{self.name}: {key}={getattr(self, key)!r} must be a positive finite number")
        for key in OPTIONAL:
            if getattr(self, key) is not None and not _positive(getattr(self, key)):
                raise ValueError(f"{self.name}: {key}={getattr(self, key)!r} must be a positive finite number")
        for key in CALIBRATED:
            value = getattr(self, key)
            if value is None:
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or (
                    value <= 0 if key == "efficiency" else value < 0) or (key == "efficiency" and value > 1):
                rule = "in (0, 1]" if key == "efficiency" else "a finite number of seconds >= 0"
                raise ValueError(f"{self.name}: {key}={value!r} must be {rule}")
        if self.ranks_per_host is not None and (not isinstance(self.ranks_per_host, int) or isinstance(
                self.ranks_per_host, bool) or self.ranks_per_host < 1):
            raise ValueError(f"{self.name}: ranks_per_host={self.ranks_per_host!r} must be a whole number >= 1")
        if not isinstance(self.gpus_per_node, int):
            raise ValueError(f"{self.name}: gpus_per_node={self.gpus_per_node!r} must be a whole number")
        object.__setattr__(self, "peak_tflops", MappingProxyType(peaks))  # profiles are shared: read-only

    def peak(self, dtype: str) -> float:
        """Dense peak TFLOP/s per GPU for matmuls whose inputs are `dtype`."""
        if dtype not in self.peak_tflops:
            raise ValueError(f"{self.name} has no {dtype!r} peak; it has {', '.join(self.peak_tflops)}")
        return self.peak_tflops[dtype]

    def float8_peak(self, share: float) -> float:
        """The dense peak TFLOP/s of a float8 run whose FLOPs are `share` in float8 matmuls (float8_mix)."""
        return float8_mix(self.peak("fp8"), self.peak("bf16"), share)

    def with_overrides(self, **fields: Any) -> Hardware:
        """A copy with some figures replaced: any of OVERRIDABLE (peak_<dtype> sets that dtype's peak). The
        source records what was overridden."""
        unknown = [k for k in fields if k not in OVERRIDABLE]
        if unknown:
            raise ValueError(f"{self.name}: unknown override(s) {', '.join(map(repr, unknown))}; valid: "
                             f"{', '.join(OVERRIDABLE)}")
        for key, value in fields.items():
            if key in CALIBRATED:
                continue  # checked by __post_init__ on the copy
            if not _positive(value) or (key == "gpus_per_node" and not isinstance(value, int)):
                kind = "a positive whole number" if key == "gpus_per_node" else "a positive finite number"
                raise ValueError(f"{self.name}: override {key}={value!r} must be {kind}")
        if not fields:
            return self  # frozen: sharing is safe
        peaks = dict(self.peak_tflops)
        peaks.update({k.removeprefix("peak_"): float(v) for k, v in fields.items() if k.startswith("peak_")})
        numbers = {k: v for k, v in fields.items() if k in NUMBERS or k in CALIBRATED or k in OPTIONAL}
        said = ", ".join(f"{k}={v}" for k, v in fields.items())
        return dataclasses.replace(self, peak_tflops=peaks, source=f"{self.source}; overridden: {said}", **numbers)


# The one datasheet table: dense peaks (no structured sparsity) per part in TFLOP/s, per dtype of the matmul
# inputs; "fp32" is the plain FP32 rate (no TF32), which fp32 matmuls run at when TF32 is off. Where a datasheet
# gives only figures "with sparsity" they are halved here; a dtype a part lacks is left out. The profiles below and
# the trainer's MFU (hpctrain.train.metrics, which matches torch's device names to these parts) both read it.
# Sources and dates: the "Sources" paragraph below.
DATASHEET_TFLOPS: dict[str, dict[str, float]] = {
    # NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column (dense figures; the 40 GB SXM part's are equal)
    "NVIDIA A100 SXM": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (tensor figures given with sparsity: halved)
    "NVIDIA H100 SXM": {"fp32": 67.0, "tf32": 989 / 2, "bf16": 1979 / 2, "fp16": 1979 / 2, "fp8": 3958 / 2},
    # the same datasheet, H100 PCIe column: tensor figures given with sparsity (756 / 1513 / 3026), halved
    "NVIDIA H100 PCIe": {"fp32": 51.0, "tf32": 756 / 2, "bf16": 1513 / 2, "fp16": 1513 / 2, "fp8": 3026 / 2},
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column (with sparsity: halved); the same GH100 tensor cores
    # and clocks as H100 SXM
    "NVIDIA H200": {"fp32": 67.0, "tf32": 989 / 2, "bf16": 1979 / 2, "fp16": 1979 / 2, "fp8": 3958 / 2},
    # NVIDIA Blackwell datasheet (GB200 NVL72 / HGX B200), per-GPU HGX B200 column (tensor figures with sparsity:
    # halved; FP32 as given)
    "NVIDIA B200": {"fp32": 75.0, "tf32": 2200 / 2, "bf16": 4500 / 2, "fp16": 4500 / 2, "fp8": 9000 / 2},
    # AMD Instinct MI250X accelerator datasheet: figures for the package of two GCDs; torch sees each GCD as one
    # device, so halved. fp32 is the FP32 matrix rate; CDNA2 has no TF32 and no FP8.
    "AMD Instinct MI250X": {"fp32": 95.7 / 2, "bf16": 383.0 / 2, "fp16": 383.0 / 2},
    # AMD Instinct MI300X (ROCm MI300 peak table, dense; fp32 is the FP32 matrix rate)
    "AMD Instinct MI300X": {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9},
}
_DS = DATASHEET_TFLOPS

# Links, per GPU and per direction (datasheets quote NVLink/xGMI as both directions added: halved here):
#   NVLink 3 (A100 SXM) 600 GB/s total -> 300; NVLink 4 (H100/H200 SXM) 900 -> 450; NVLink 5 (B200) 1.8 TB/s -> 900.
#   H100 PCIe: its NVLink bridge joins only pairs of cards, so a ring over a node's 8 cards runs on PCIe Gen5 x16,
#   128 GB/s total -> 64 (a tp=2 group on a bridged pair sees 300: override intra_node_gbps).
#   MI250X: one xGMI link is 50 GB/s per direction (ROCm MI250 microarchitecture page); GCDs of different packages
#   on a Frontier/LUMI-style board are joined by one or two links, so an 8-GCD ring is bounded by one link -> 50.
#   MI300X: 7 xGMI links per GPU to the 7 others, 64 GB/s per direction each (128 GB/s per link, 896 GB/s
#   aggregate on the datasheet) -> 7 x 64 = 448 for collectives spread over all links, as NVLink's 450.
# Inter-node, one NIC per GPU (rail-optimised designs): HDR 200 Gb/s = 25 GB/s (DGX A100); NDR 400 Gb/s = 50 GB/s
#   (DGX H100/H200/B200: 8 x ConnectX-7; MI300X platforms with 8 x 400G). MI250X (HPE Cray EX, Frontier/LUMI): one
#   200 Gb/s Slingshot NIC per package, shared by its two GCDs -> 12.5. PCIe servers often have fewer NICs than GPUs.
#
# Sources, checked against what the project's search tools could reach (vendor PDFs themselves mostly could not be
# opened; where only a faithful reproduction of a vendor table was reachable it is named). "*": given with sparsity.
#   a100-40g/80g: NVIDIA A100 Tensor Core GPU datasheet, SXM columns (nvidia.com/content/dam/en-zz/Solutions/
#     Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), read through its tabulation at
#     glennklockwood.com/garden/processors/A100: fp32 19.5, tf32 156, bf16/fp16 312 dense, 40 GB / 80 GB, NVLink
#     300+300 GB/s; 600 GB/s NVLink 3 also in the NVIDIA Ampere architecture whitepaper. Confirmed: all peaks, memory,
#     NVLink. HDR 200 Gb/s per GPU (DGX A100, 8 x ConnectX-6): not found in a primary source here; value as first
#     written, from memory (DGX A100: 8 x ConnectX-6 HDR).
#   h100-sxm, h100-pcie: NVIDIA H100 Tensor Core GPU datasheet, SXM and PCIe columns (reproduced at
#     archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html): fp32 67 / 51, tf32 989* / 756*, bf16 = fp16 1979* /
#     1513*, fp8 3958* / 3026*, 80 GB both, NVLink 900 GB/s (SXM) / 600 GB/s bridge (PCIe), PCIe Gen5 128 GB/s. NVLink
#     900 GB/s bidirectional per GPU also on nvidia.com's Hopper architecture page. DGX H100 (NVIDIA DGX BasePOD
#     reference architecture, "Core Components", docs.nvidia.com/dgx-basepod/reference-architecture-infrastructure-
#     foundation-enterprise-ai/latest/core-components.html): 640 GB in 8 GPUs, 8 x single-port ConnectX-7 up to
#     400 Gb/s. Confirmed: every h100 figure (PCIe inter-node 50 assumes a NIC per card, a platform choice).
#   h100-96g-500w: torchtitan's docs/performance.md (github.com/pytorch/torchtitan), its benchmark platform: Grand
#     Teton hosts of 8 H100 fully connected with NVLink, each with 96 GB HBM2e at 2.4 TB/s peak memory bandwidth, at
#     the default 500 W power limit, 400 Gb/s of RDMA per GPU between hosts. No compute peak is published for the
#     part at 500 W (torchtitan's benchmark notes put it between NVL and SXM): the SXM figures stand as an upper
#     bound (the same GH100; the cap lowers sustained clocks by an unpublished amount), so the planner is optimistic
#     on it unless given a measured peak (--hw peak_bf16=...). Confirmed: memory, bandwidth, NVLink, network, power.
#   host_link_gbps (PCIe, per direction): the A100 datasheet's PCIe Gen4 64 GB/s and the H100 datasheet's PCIe Gen5
#     128 GB/s are both directions together -> 32 and 64. Not set where no source was reached (h200, b200, AMD).
#   h200: same BasePOD page: DGX H200 1,128 GB in 8 GPUs (-> 141), same 8 x ConnectX-7 400 Gb/s. Confirmed: memory,
#     network. Peaks: the H200 datasheet itself not reached; secondary copies of it give bf16 1979* and fp8 3958*,
#     equal to H100 SXM (same GH100 silicon); fp32 67 / tf32 989* taken as H100 SXM's.
#   b200 (HGX B200 column, 1,000 W, chosen over DGX B200 marketing totals): NVIDIA Blackwell datasheet (GB200 NVL72 /
#     HGX B200), reproduced at zdszero.github.io/Computer/Artificial_Intelligence/Hardware.html: fp32 75, tf32 2.2
#     PF*, bf16 = fp16 4.5 PF*, fp8 9 PF*, 180 GB HBM3E, NVLink 5 1.8 TB/s. DGX B200 (BasePOD page above): 8 GPUs,
#     1.4 TB GPU memory, 8 x single-port ConnectX-7 up to 400 Gb/s; its 72 PF FP8* over 8 GPUs agrees with 9 PF*.
#     Confirmed: all. (glennklockwood.com/garden/processors/B200, from an earlier NVIDIA brief, gives fp32 80 at
#     1,000 W; the datasheet's 75 is kept. The DGX B200 user guide itself was not reached.)
#   mi250x (per GCD): AMD's MI250X spec table (128 GB HBM2e; FP32 matrix 95.7, FP16 = BF16 383.0 TFLOPs per
#     package) was reached only as a reproduction (zexron.com); ROCm "AMD Instinct MI250 microarchitecture"
#     (rocm.docs.amd.com, gpu-arch/mi250) gives the MI250's 90.5 / 362.1 for 208 CUs, which scale to 95.7 / 383.0 at
#     the MI250X's 220, and 50 GB/s per xGMI link per direction. OLCF Frontier User Guide (docs.olcf.ornl.gov/
#     systems/frontier_user_guide.html): 4 MI250X = 8 GCDs per node, 64 GB HBM2E per GCD, 50-100 GB/s between GCDs
#     of different packages. Confirmed: peaks, memory, xGMI. Slingshot 200 Gb/s per package: not found in a primary
#     source here; value as first written, from memory (HPE Cray EX235a: 4 NICs a node).
#   mi300x: ROCm "AMD Instinct MI300 series microarchitecture" (rocm.docs.amd.com/en/docs-6.2.2/conceptual/gpu-arch/
#     mi300.html), peak table: FP32 163.4, TF32 653.7, FP16 = BF16 1307.4, FP8 2614.9 (dense), 7 Infinity Fabric
#     links fully connecting 8 GPUs. Azure ND MI300X v5 size page (learn.microsoft.com, MicrosoftDocs/azure-docs
#     nd-mi300x-v5-series.md): 8 MI300X of 192 GB, InfiniBand 8 x 400 Gb NDR. Confirmed: peaks, memory, link count,
#     network. 128 GB/s per xGMI link (-> 64 per direction): not found in a primary source here (secondary pages
#     disagree); value from the AMD MI300X datasheet as remembered.
#   hbm_gbps (GPU memory bandwidth, per GPU or GCD) from the same tables: A100 40 GB 1,555 and 80 GB 2,039 GB/s;
#     H100 SXM 3.35 TB/s, PCIe 2 TB/s; H200 4.8 TB/s; HGX B200 8 TB/s; MI250X 3.2 TB/s per package (3,276.8 GB/s,
#     halved per GCD); MI300X 5.3 TB/s.
_NV = "NVIDIA"
PROFILES: dict[str, Hardware] = {h.name: h for h in (
    Hardware("a100-40g", _DS["NVIDIA A100 SXM"], 40, 300, 25, 8,
             f"{_NV} A100 datasheet (SXM 40GB); NVLink 3; HDR 200 Gb/s per GPU", host_link_gbps=32, hbm_gbps=1555),
    Hardware("a100-80g", _DS["NVIDIA A100 SXM"], 80, 300, 25, 8,
             f"{_NV} A100 datasheet (SXM 80GB); NVLink 3; HDR 200 Gb/s per GPU", host_link_gbps=32, hbm_gbps=2039),
    Hardware("h100-sxm", _DS["NVIDIA H100 SXM"], 80, 450, 50, 8,
             f"{_NV} H100 datasheet (SXM); NVLink 4; NDR 400 Gb/s per GPU", host_link_gbps=64, hbm_gbps=3350),
    Hardware("h100-pcie", _DS["NVIDIA H100 PCIe"], 80, 64, 50, 8,
             f"{_NV} H100 datasheet (PCIe); PCIe Gen5 x16; NDR 400 Gb/s", host_link_gbps=64, hbm_gbps=2000),
    # the power-capped H100 of torchtitan's Llama 3.1 benchmarks (Grand Teton hosts): 96 GB HBM2e at 2.4 TB/s, 500 W;
    # the SXM peaks are an upper bound (sources above)
    Hardware("h100-96g-500w", _DS["NVIDIA H100 SXM"], 96, 450, 50, 8,
             f"{_NV} H100 96 GB HBM2e at 500 W (torchtitan's Grand Teton hosts); SXM peaks as an upper bound; "
             "NVLink 4; 400 Gb/s per GPU", host_link_gbps=64, hbm_gbps=2400),
    Hardware("h200", _DS["NVIDIA H200"], 141, 450, 50, 8,
             f"{_NV} DGX H200 (141 GB); H100 SXM peaks; NVLink 4; NDR 400 Gb/s/GPU", hbm_gbps=4800),
    # Blackwell datasheet HGX B200 column: 180 GB per GPU; DGX B200: 8 x ConnectX-7 400 Gb/s (sources above)
    Hardware("b200", _DS["NVIDIA B200"], 180, 900, 50, 8,
             f"{_NV} Blackwell datasheet (HGX B200); DGX BasePOD RA; NVLink 5", hbm_gbps=8000),
    # 128 GB per package, 64 GB per GCD; 8 GCDs (4 packages) per node
    Hardware("mi250x", _DS["AMD Instinct MI250X"], 64, 50, 12.5, 8, "AMD Instinct MI250X datasheet, per GCD; ROCm "
             "MI250 microarchitecture (xGMI); HPE Cray EX node (Slingshot 200 Gb/s per package)", hbm_gbps=1638.4),
    Hardware("mi300x", _DS["AMD Instinct MI300X"], 192, 448, 50, 8,
             "ROCm MI300 microarchitecture; 8-GPU xGMI; 400 Gb/s/GPU", hbm_gbps=5300),
)}


NO_DATASHEET = ("a CPU has no datasheet figures: calibrate the machine the job runs on with `hpctrain plan "
                "--calibrate -o FILE` and name FILE in job.hw_profile (or `hpctrain plan --profile FILE`)")


def float8_mix(fp8: float, bf16: float, share: float) -> float:
    """The peak of a float8 run whose FLOPs are `share` in float8 matmuls (the blocks' linears: torchao's
    Float8Linear) at `fp8` and the rest (attention's scores and values, the output projection) at `bf16`: the rate
    at which the whole takes as long as its parts, each at its own peak. MFU's peak for train.precision = "fp8"."""
    if not 0 <= share <= 1:
        raise ValueError(f"float8 share of the FLOPs {share} must be within [0, 1]")
    return 1.0 / (share / fp8 + (1 - share) / bf16)


def profile(name: str, overrides: Mapping[str, Any] | None = None) -> Hardware:
    """The profile called `name`, with `overrides` (keys of OVERRIDABLE, positive numbers) applied."""
    if name == CPU:
        raise ValueError(f"hardware profile {name!r}: {NO_DATASHEET}")
    if name not in PROFILES:
        raise ValueError(f"unknown hardware profile {name!r}; valid: {', '.join(PROFILES)}")
    table = isinstance(overrides, Mapping) and all(isinstance(k, str) for k in overrides)
    if overrides is not None and not table:
        raise ValueError(f"overrides for {name} must be a table of named figures, not {overrides!r}")
    return PROFILES[name].with_overrides(**dict(overrides or {}))


BENCH_GROUPS = {"intra": "intra_node_gbps", "inter": "inter_node_gbps"}
MAX_BENCH_BYTES = 16 << 20  # a bench.jsonl is a few KB; refuse anything absurd before reading it


def bandwidths_from_bench(path: str | Path, world_is_one_node: bool = False) -> dict[str, float]:
    """Link bandwidths measured by `hpctrain bench`, as profile overrides: from its JSON lines (bench.jsonl, or the
    -J copy; one object per line as hpctrain.bench.sweep.Row.to_json writes it), the all_reduce bus bandwidth
    (GB/s, best placement) at the largest size measured on the torch backend, for each group found:
    `--group intra` gives intra_node_gbps and `--group inter` (the same local rank of every node, so one GPU's own
    network path) gives inter_node_gbps. A run measures one group: concatenate the files of both runs.

    Rows do not say how many nodes a run had, so world-group rows are used only when the caller knows the job ran
    on one node (world_is_one_node: the world group is then the intra group). On several nodes a world ring's bus
    bandwidth approaches the node's NIC bandwidth summed over its GPUs, neither figure here, so it is not used;
    nor are tp/dp/pp groups, whose placement the file does not record. Only the groups found are returned.

    The file is untrusted: parsed as bounded JSON (hpctrain.untrusted), every row's fields checked, and a
    ValueError names the file, the line and the offending key."""
    path = Path(path)
    if path.stat().st_size > MAX_BENCH_BYTES:
        raise ValueError(f"{path}: {path.stat().st_size} bytes is too large for a bench results file")
    best: dict[str, tuple[int, float]] = {}
    groups: set[str] = set()
    text = read_bytes(path, MAX_BENCH_BYTES).decode("utf-8", errors="replace")
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = parse_json(line, f"{path}: line {n}")
        except Untrusted as e:
            raise ValueError(f"{path}: line {n} is not JSON as `hpctrain bench` writes it ({e})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}: line {n} is a {type(row).__name__}, not a result row (a JSON object)")
        for key, kind in (("coll", str), ("group", str), ("backend", str), ("size", int)):
            if key not in row:
                raise ValueError(f"{path}: line {n}: key {key!r} is missing")
            if not isinstance(row[key], kind) or isinstance(row[key], bool) or (kind is int and row[key] <= 0):
                raise ValueError(f"{path}: line {n}: key {key!r} is {row[key]!r}, not a "
                                 f"{'positive whole number' if kind is int else 'string'}")
        measured = []
        for key in ("ip_busbw", "oop_busbw"):
            if key not in row:
                raise ValueError(f"{path}: line {n}: key {key!r} is missing")
            if row[key] is not None and not _positive(row[key]):
                raise ValueError(f"{path}: line {n}: key {key!r} is {row[key]!r}, not a positive finite number "
                                 "(GB/s) or null")
            if row[key] is not None:
                measured.append(float(row[key]))
        groups.add(row["group"])
        target = BENCH_GROUPS.get(row["group"]) or ("intra_node_gbps" if row["group"] == "world" and
                                                    world_is_one_node else None)
        if row["coll"] != "all_reduce" or row["backend"] != "torch" or target is None:
            continue
        if not measured:
            raise ValueError(f"{path}: line {n}: keys 'ip_busbw' and 'oop_busbw' are both null")
        best[target] = max(best.get(target, (0, 0.0)), (row["size"], max(measured)))  # largest size, best bw
    if not best:
        raise ValueError(f"{path}: no torch all_reduce result on the intra or inter group (groups found: "
                         f"{', '.join(sorted(groups)) or 'none'}); run `hpctrain bench all_reduce --group intra` "
                         "and `--group inter`")
    return {key: bw for key, (_, bw) in best.items()}


def parse_figures(items: Sequence[str]) -> dict[str, float]:
    """`hpctrain plan --hw KEY=VALUE` items as profile overrides (validated by with_overrides): a number each,
    gpus_per_node a whole one."""
    out: dict[str, float] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or key.strip() not in OVERRIDABLE:
            raise ValueError(f"--hw {item!r}: expected KEY=VALUE with KEY one of {', '.join(OVERRIDABLE)}")
        try:
            out[key.strip()] = int(text) if key.strip() == "gpus_per_node" else float(text)
        except ValueError:
            raise ValueError(f"--hw {item!r}: {text!r} is not a number") from None
    return out


PROFILE_FORMAT = "hpctrain hardware profile 2"  # 2: memory_gib (1 had memory_gb)  # the "format" key of a profile file
MAX_PROFILE_BYTES = 1 << 16  # a profile file is a few hundred bytes


def profile_json(hw: Hardware) -> dict[str, Any]:
    """What save_profile writes and load_profile reads: every figure of hw (None where unknown)."""
    out = {"format": PROFILE_FORMAT} | {f.name: getattr(hw, f.name) for f in dataclasses.fields(hw)}
    return out | {"peak_tflops": dict(hw.peak_tflops)}


def save_profile(hw: Hardware, path: str | Path) -> None:
    import json
    Path(path).write_text(json.dumps(profile_json(hw), indent=1) + "\n")


def load_profile(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Hardware:
    """A profile file (save_profile's JSON, as `hpctrain plan --calibrate` writes it), with overrides applied.
    Untrusted: parsed as bounded JSON (hpctrain.untrusted); every key checked by Hardware itself; a ValueError
    names the file and the offending key."""
    path = Path(path)
    try:
        raw = parse_json(read_bytes(path, MAX_PROFILE_BYTES), str(path))
    except (Untrusted, OSError) as e:
        raise ValueError(f"{path}: not a hardware profile file ({e})") from None
    if not isinstance(raw, dict) or raw.get("format") != PROFILE_FORMAT:
        got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(f"{path}: format {got!r} is not {PROFILE_FORMAT!r} (write one with `hpctrain plan "
                         f"--calibrate -o {path}`)")
    fields = {f.name for f in dataclasses.fields(Hardware)}
    unknown = sorted(set(raw) - fields - {"format"})
    missing = sorted(f for f in ("name", "peak_tflops", "memory_gib", "gpus_per_node", "source") if f not in raw)
    if unknown or missing:
        raise ValueError(f"{path}: unknown key(s) {unknown} / missing key(s) {missing}")
    if not isinstance(raw["peak_tflops"], dict) or not isinstance(raw["name"], str) or not isinstance(
            raw["source"], str):
        raise ValueError(f"{path}: name and source must be strings, peak_tflops a table")
    raw = {k: v for k, v in raw.items() if k != "format"}
    raw.setdefault("intra_node_gbps", None)
    raw.setdefault("inter_node_gbps", None)
    try:
        hw = Hardware(**raw | {"measured": True})
        return hw.with_overrides(**dict(overrides or {}))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None


def job_profile(gpu: str, hw_profile: str) -> Hardware | None:
    """The profile a job's layout is judged on: job.hw_profile's calibration when set, else job.gpu's datasheet
    profile; None when neither is set (a CPU job without a calibration: a CPU has no datasheet; the caller says so).
    ValueError for an unknown name (job.gpu = "cpu" included: NO_DATASHEET) or a bad file."""
    if hw_profile:
        return load_profile(hw_profile)
    if gpu:
        return profile(gpu)
    return None

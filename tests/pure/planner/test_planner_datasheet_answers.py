"""The planner and the doctor give the answers they gave before the datasheet table, the recompute rule and the
CPU calibration moved (issue 27): for every datasheet profile, four layouts of the examples (ac none, every, full;
ZeRO 0 and 3), the search's best layouts, the doctor's expected figures and the recompute counts, compared with
tests/golden/planner_datasheet.json, which answers() wrote from the code before the change (commit 3ed2910).
Rewritten on purpose once since (issue 30): the narrow matmuls' memory-bound time moved 16 of its 132 answers, the
step times of the 70B and gpu-4x8 examples on H100, H200-class, B200 and MI300X profiles, by 0.1-0.6%.

    # rewrite (on purpose)
    python tests/pure/planner/test_planner_datasheet_answers.py tests/golden/planner_datasheet.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
GOLDEN = REPO / "tests" / "golden" / "planner_datasheet.json"
CASES = {
    "70b": ("slurm/examples/llama-70b.toml", []),
    "gpu4x8": ("slurm/examples/gpu-4x8.toml", []),
    "gpu4x8_ac_every": ("slurm/examples/gpu-4x8.toml", ["train.ac=every", "train.ac_every=3"]),
    "gpu4x8_ac_full_z3": ("slurm/examples/gpu-4x8.toml", ["train.ac=full", "parallel.zero_stage=3"]),
}
KEYS = ("memory_gib_per_gpu", "peak_gib", "activations_gib", "step_time_s", "tokens_per_s", "mfu", "hfu", "fits",
        "time_terms", "notes")


def answers() -> dict:
    from hpctrain.config import load_config
    from hpctrain.doctor import report as doctor
    from hpctrain.planner import hardware, report, search, timing
    from hpctrain.planner.activations import ActivationModel

    out: dict = {}
    names = [n for n in hardware.PROFILES if n != "cpu"]  # the datasheet profiles ("cpu" was ours, measured)
    for name in names:
        for key, (path, overrides) in CASES.items():
            got = report.evaluate(load_config(REPO / path, overrides), hardware.profile(name), 5.0)
            out[f"{name}/{key}"] = {k: got[k] for k in KEYS}
        out[f"doctor/{name}"] = doctor.expected_figures(name)
    fit, why = search.search(load_config(REPO / "slurm/examples/gpu-4x8.toml", []), hardware.profile("h100-sxm"),
                             5.0, 6000.0, 64)
    out["search"] = [[o["layout"], o["step_time_s"], o["memory_gib_per_gpu"]] for o in fit[:20]]
    out["search_refused"] = why
    for n in (1, 2, 5, 7, 80):
        for ac in ("none", "full", "every"):
            for k in (1, 2, 3):
                out[f"checkpointed/{n}/{ac}/{k}"] = ActivationModel.checkpointed(n, ac, k)
                out[f"recomputed_share/{n}/{ac}/{k}"] = timing.recomputed_share(n, ac, k)
    return json.loads(json.dumps(out))  # tuples as lists, as the golden file holds them


@pytest.mark.skipif(not GOLDEN.exists(), reason="no golden file")
def test_datasheet_answers_unchanged() -> None:
    want, got = json.loads(GOLDEN.read_text()), answers()
    assert sorted(got) == sorted(want)
    wrong = [k for k in want if got[k] != want[k]]  # exact: the same arithmetic on the same figures
    assert not wrong, {k: (want[k], got[k]) for k in wrong[:3]}


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    Path(sys.argv[1]).write_text(json.dumps(answers(), indent=0, sort_keys=True) + "\n")

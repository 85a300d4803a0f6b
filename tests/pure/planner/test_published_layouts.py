"""Pure tier: the published layouts in slurm/examples/published/ are what their papers ran (shape, layout, batch, as
recorded in tests/data/published_runs.json), `hpctrain plan` predicts each to fit its 80 GB GPUs (80 GiB) with a
step time within 15% of the published one, and `hpctrain submit --dry-run` accepts each.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q -s tests/pure/planner/test_published_layouts.py
"""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from helpers.launch import REPO
from hpctrain.cli.main import main as cli
from hpctrain.config import load_config
from hpctrain.planner.hardware import profile
from hpctrain.planner.report import evaluate

PUBLISHED = REPO / "slurm" / "examples" / "published"
RUNS = {r["id"]: r for r in json.loads((REPO / "tests/data/published_runs.json").read_text())["runs"]}
CONFIGS = {  # config -> the row it reproduces, and what differs from the row's columns
    "gpt-22b.toml": ("korthikanti-22b-tp8", {}),
    "gpt3-175b.toml": ("korthikanti-gpt3-175b-tp8-pp8", {}),
    # the row is the 2240-GPU run (dp 8); its notes give the 280-GPU one (dp 1) this config is: 37.83 s
    "mt-nlg-530b.toml": ("korthikanti-530b-tp8-pp35-dp8", {"num_gpus": 280, "global_batch_seqs": 280,
                                                           "step_time_s": 37.83}),
}


def _row(name: str) -> tuple[dict, dict]:
    """(the row, as it applies to the config: num_gpus, global_batch_seqs and step_time_s per the config's note)."""
    row_id, changes = CONFIGS[name]
    row = RUNS[row_id]
    facts = {"num_gpus": row["num_gpus"], "global_batch_seqs": row["batch"]["global_batch_seqs"],
             "step_time_s": row["reported"]["step_time_s"]} | changes
    return row, facts
TOLERANCE = 0.15


def test_every_published_config_is_checked() -> None:
    assert sorted(p.name for p in PUBLISHED.glob("*.toml")) == sorted(CONFIGS)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_is_the_published_run(name) -> None:
    cfg, (row, facts) = load_config(PUBLISHED / name, []), _row(name)
    m, lay, b = row["model"], row["layout"], row["batch"]
    assert (cfg.model.n_layers, cfg.model.dim, cfg.model.n_heads, cfg.model.ffn_dim or 4 * cfg.model.dim,
            cfg.model.vocab_size, cfg.data.seq_len) == (m["n_layers"], m["dim"], m["n_heads"], m["ffn_dim"],
                                                        m["vocab_size"], m["seq_len"])
    assert cfg.model.mlp == m["activation"] == "gelu" and (cfg.model.n_kv_heads or cfg.model.n_heads) == m["n_kv_heads"]
    assert cfg.model.tie_embeddings == m["tied_embeddings"]  # under pp: the last rank's synchronised copy
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.world_size) == (lay["tp"], lay["pp"], facts["num_gpus"])
    assert cfg.parallel.sequence_parallel == lay["sequence_parallel"]
    assert cfg.parallel.pp_virtual_stages == (lay["virtual_stages"] or 1)
    assert cfg.train.micro_batch_size == b["micro_batch_seqs"]
    dp = facts["num_gpus"] // (lay["tp"] * lay["pp"])
    assert cfg.train.micro_batch_size * cfg.train.grad_accum * dp == facts["global_batch_seqs"]
    assert cfg.job.gpu == row["gpu"] and cfg.train.precision == "bf16"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_plan_fits_and_times_the_published_step(name) -> None:
    cfg, (_, facts) = load_config(PUBLISHED / name, []), _row(name)
    out = evaluate(cfg, profile(cfg.job.gpu), 5.0)
    published = facts["step_time_s"]
    error = out["step_time_s"] / published - 1
    print(f"\n{name}: {out['memory_gib_per_gpu']:.1f} GiB of {out['gpu_memory_gib']:g} GiB per GPU; step "
          f"{out['step_time_s']:.2f} s, published {published} s ({error:+.1%})")
    assert out["fits"] and out["gpu_memory_gib"] == 80, out["notes"]
    assert abs(error) <= TOLERANCE


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_dry_run_accepts_it(name, tmp_path) -> None:
    res = CliRunner().invoke(cli, ["submit", str(PUBLISHED / name), "--dry-run", "--set", f"job.run_root={tmp_path}",
                                   "--set", f"checkpoint.dir={tmp_path / 'ck'}"])
    assert res.exit_code == 0, res.output
    assert "-> fits" in res.output and "#SBATCH --nodes=" in res.output

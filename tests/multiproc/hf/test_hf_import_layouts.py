"""train.init_from = "hf:DIR" in parallel layouts, 4 gloo ranks: a random transformers LlamaForCausalLM (GQA,
untied, vocabulary 100 padded, 4 layers, saved sharded with an index) imported at tp=2 x dp=2 ZeRO-3, pp=2 x
tp=2, pp=2 x dp=2 and interleaved pp=2 (2 stages a rank) x dp=2 ZeRO-2, and a tied one at tp=2 x dp=2 ZeRO-2
(still one matrix), holds exactly the HF weights on every shard and stage (each rank read only its slices),
and its logits equal transformers' within 1e-4 in fp32; the pp=2 x tp=2 import saved as a checkpoint and exported
with `hpctrain ckpt export --format hf` gives back the same tensors and logits. A nan in the rows only tp rank 1
reads stops both ranks, each naming the tensor. One process: tests/pure/hf/test_hf_import.py.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/hf/test_hf_import_layouts.py
"""
from __future__ import annotations

import json
import sys

import pytest
import torch
from faults import record
from hfcheck import LOGIT_TOL, hf_logits, hpctrain_logits, make_hf_llama, ours_as_hf, tokens

from helpers.launch import WORKERS, free_base_port, spawn_cases, spawn_ranks
from hpctrain.model.dims import ModelDims

RUN = ["model.max_seq_len=64", "data.source=synthetic", "data.seq_len=16", "train.steps=1", "train.log_every=100",
       "train.peak_tflops=1", "train.micro_batch_size=2", "parallel.timeout_s=180"]
LAYOUTS = {
    "tp2dp2_zero3": ["parallel.tp=2", "parallel.zero_stage=3"],
    "pp2tp2": ["parallel.pp=2", "parallel.tp=2", "train.grad_accum=2"],
    "pp2dp2": ["parallel.pp=2", "train.grad_accum=2"],
    # two stages per rank (layers 0 and 2 on rank 0), FSDP under the stages
    "pp2v2dp2_zero2": ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2",
                       "parallel.zero_stage=2", "train.grad_accum=2"],
    # a tied directory (no lm_head.weight): the one embedding matrix sharded over tp and FSDP's dp
    "tp2dp2_zero2_tied": ["parallel.tp=2", "parallel.zero_stage=2"],
}
TIED = {"tp2dp2_zero2_tied"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("hfimport")
    theirs = make_hf_llama(out / "hf", layers=4, max_shard_size="60KB", seed=3)
    tied = make_hf_llama(out / "hf-tied", layers=4, tied=True, seed=4)
    cases = [{"name": name, "save": name == "pp2tp2",
              "overrides": RUN + sets + [f"train.init_from=hf:{out / ('hf-tied' if name in TIED else 'hf')}"]}
             for name, sets in LAYOUTS.items()]
    spawn_cases("hf_import_worker.py", out, cases, run_id="hfimport")
    return {"out": out, "theirs": theirs, "tied": tied} | {name: torch.load(out / f"{name}.pt") for name in LAYOUTS}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_holds_the_hf_weights(runs, layout) -> None:
    got, source = runs[layout], ("hf-tied", "tied") if layout in TIED else ("hf", "theirs")
    assert got["resumed"] is None
    assert got["tied"] == (layout in TIED)  # one matrix for both ends on every rank, as the directory says
    mine = ours_as_hf(got["weights"], 100)
    assert mine.keys() == runs[source[1]].keys()
    for k, v in runs[source[1]].items():
        assert torch.equal(mine[k], v), (layout, k)
    for name in ("tok_embeddings.weight", "output.weight"):
        assert torch.count_nonzero(got["weights"][name][100:]) == 0
    dims = ModelDims(**got["dims"])
    ids = tokens(100, 24)
    ours = hpctrain_logits(got["weights"], dims, ids)
    assert ours.abs().max() > 0.1
    assert (ours - hf_logits(runs["out"] / source[0], ids)).abs().max().item() < LOGIT_TOL


def test_export_from_pipeline_checkpoint_gives_back_the_hf_model(runs, tmp_path) -> None:
    from safetensors.torch import load_file

    from hpctrain.hf.export import export_hf

    ckpt = runs["out"] / "pp2tp2-ck" / "step_00000000"
    export_hf(ckpt, tmp_path / "back")
    back = {}
    for f in (tmp_path / "back").glob("*.safetensors"):
        back.update(load_file(f))
    assert back.keys() == runs["theirs"].keys()
    for k, v in runs["theirs"].items():
        assert torch.equal(back[k], v), k
    ids = tokens(100, 24, seed=1)
    assert (hf_logits(tmp_path / "back", ids) - hf_logits(runs["out"] / "hf", ids)).abs().max() == 0


@pytest.mark.faults
def test_a_nan_one_rank_reads_stops_every_rank(tmp_path) -> None:
    """Each rank reads only its own slices, so only tp rank 1 sees a nan in the last rows of q_proj: every rank
    must fail on it (rank 0 with rank 1's message), not go on into a collective that rank 1 never reaches."""
    from safetensors.torch import load_file, save_file

    make_hf_llama(tmp_path / "hf", dim=64)
    f = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(f)
    key = "model.layers.0.self_attn.q_proj.weight"
    tensors[key][-1, 0] = float("nan")  # row 63 of 64: tp rank 1's half
    save_file(tensors, f, metadata={"format": "pt"})
    cases = [{"name": "nan", "overrides": RUN + ["parallel.tp=2", "parallel.timeout_s=60",
                                                 f"train.init_from=hf:{tmp_path / 'hf'}"]}]
    cmd = [sys.executable, str(WORKERS / "hf_import_worker.py"), str(tmp_path), json.dumps(cases),
           str(free_base_port(1))]
    procs = spawn_ranks(2, cmd, ranks_per_node=2, run_id="hfnan")
    logs = [p.communicate(timeout=300)[0] for p in procs]
    errors = [json.loads((tmp_path / f"errors-rank{r}.json").read_text()).get("nan", "") for r in range(2)]
    for rank, error in enumerate(errors):
        assert str(f) in error and key in error and "1 nan or inf values" in error, (rank, errors, logs)
    assert errors[0].startswith("ValueError: rank 1: ")
    record("HF weights with a NaN in the slice only one rank reads (tp=2)", "every rank fails before training "
           "naming the file and the tensor", tier="multi-process")

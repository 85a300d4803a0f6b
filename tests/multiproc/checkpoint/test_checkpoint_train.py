"""Checkpoints in training, multi-process on CPU (4 gloo ranks): a run preempted (USR2) at step 4 and resumed
in the same layout is bitwise the uninterrupted run; the same checkpoint (dp=2, tp=2, ZeRO-3) loads into dp=4 and
tp=4 and the following losses match; an asynchronous save writes the same bytes as a synchronous one. A pipeline
checkpoint (pp=2 x tp=2) resumes bitwise in its own layout and reshards to pp=1 x tp=2 x dp=2 (ZeRO-3) and to
pp=4; the pipeline run's summary carries its per-stage timing and bubble. The tp2 x dp2 ZeRO-3 checkpoint of a GQA
model exported for Hugging Face gives transformers the trained model's logits (the 1-rank export and the export's
other checks: tests/multiproc/hf/test_hf_export.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from faults import record

from helpers.ckpt_bytes import assert_bitwise_equal, stored_datasets
from helpers.launch import WORKERS, free_base_port, spawn_ranks
from hpctrain.checkpoint.manager import committed

LAYOUT = ["parallel.tp=2", "parallel.zero_stage=3", "train.micro_batch_size=4"]
PP_LAYOUT = ["model.n_layers=4", "parallel.pp=2", "parallel.tp=2", "train.micro_batch_size=2", "train.grad_accum=4"]
HF_MODEL = ["model.n_kv_heads=2", "model.vocab_size=200", "train.lr=0.05"]
TIED = ["model.tie_embeddings=true"]
GELU = ["model.mlp=gelu"]
TIED_PP = TIED + ["parallel.pp=2", "parallel.zero_stage=1", "train.micro_batch_size=1", "train.grad_accum=4"]
LOSS_TOL, WEIGHT_TOL = 2e-5, 2e-4  # across layouts: fp32 reduction order differs


def _cases(out: Path) -> list[dict]:
    ck = lambda name: f"checkpoint.dir={out / name}"  # noqa: E731
    step4 = out / "ckB" / "step_00000004"
    pp4 = out / "ckP" / "step_00000004"
    tied4 = out / "ckT" / "step_00000004"
    gelu4 = out / "ckL" / "step_00000004"
    return [
        {"name": "pp_full", "overrides": PP_LAYOUT + ["train.steps=8", "checkpoint.every_steps=4", ck("ckP"),
                                                      "checkpoint.at_end=false"]},
        {"name": "pp_resumed", "overrides": PP_LAYOUT + ["train.steps=8", f"train.resume={pp4}", ck("ckP2"),
                                                         "checkpoint.at_end=false"]},
        {"name": "pp_to_tp2dp2", "overrides": ["model.n_layers=4", "parallel.tp=2", "parallel.zero_stage=3",
                                               "train.micro_batch_size=2", "train.grad_accum=2", "train.steps=8",
                                               f"train.resume={pp4}", ck("ckQ"), "checkpoint.at_end=false"]},
        {"name": "pp_to_pp4", "overrides": ["model.n_layers=4", "parallel.pp=4", "train.micro_batch_size=2",
                                            "train.grad_accum=4", "train.steps=8", f"train.resume={pp4}", ck("ckR"),
                                            "checkpoint.at_end=false"]},
        {"name": "full", "overrides": LAYOUT + ["train.steps=8", ck("ckA"), "checkpoint.at_end=false"]},
        {"name": "first", "overrides": LAYOUT + ["train.steps=8", ck("ckB")], "preempt_at": 4},
        {"name": "resumed", "overrides": LAYOUT + ["train.steps=8", ck("ckB"), "checkpoint.at_end=false"]},
        {"name": "dp4", "overrides": ["parallel.zero_stage=3", "train.micro_batch_size=2", "train.steps=8",
                                      f"train.resume={step4}", ck("ckD"), "checkpoint.at_end=false"]},
        {"name": "tp4", "overrides": ["parallel.tp=4", "train.steps=8", f"train.resume={step4}", ck("ckE"),
                                      "checkpoint.at_end=false"]},
        # ZeRO-1 with tp (the distributed optimizer) loads a ZeRO-3 checkpoint, saves its own at step 6, and
        # dp=4 ZeRO-3 goes on from that
        {"name": "zero1_tp2", "overrides": ["parallel.tp=2", "parallel.zero_stage=1", "train.micro_batch_size=4",
                                            "train.steps=8", f"train.resume={step4}", "checkpoint.every_steps=2",
                                            ck("ckZ"), "checkpoint.at_end=false"]},
        {"name": "zero1_to_dp4", "overrides": ["parallel.zero_stage=3", "train.micro_batch_size=2", "train.steps=8",
                                               f"train.resume={out / 'ckZ' / 'step_00000006'}", ck("ckZ2"),
                                               "checkpoint.at_end=false"]},
        # fused projections keep the parameters' names: tp2 with sequence parallel and ZeRO-1 runs them from the
        # separate projections' ZeRO-3 checkpoint, saves at step 6 and at its end; plain dp=4 ZeRO-3 goes on from step 6
        {"name": "fused_tp2", "overrides": ["parallel.tp=2", "parallel.sequence_parallel=true",
                                            "parallel.zero_stage=1", "train.micro_batch_size=4",
                                            "model.fused_projections=true", "train.steps=8", f"train.resume={step4}",
                                            "checkpoint.every_steps=2", ck("ckU")]},
        {"name": "fused_to_dp4", "overrides": ["parallel.zero_stage=3", "train.micro_batch_size=2", "train.steps=8",
                                               "train.ac=selective",
                                               f"train.resume={out / 'ckU' / 'step_00000006'}", ck("ckU2"),
                                               "checkpoint.at_end=false"]},
        # context parallel holds no state: cp2 x dp2 ZeRO-3 goes on from the step-4 checkpoint and saves at step 6,
        # the first layout goes on from that
        {"name": "cp2", "overrides": ["parallel.cp=2", "parallel.zero_stage=3", "train.micro_batch_size=4",
                                      "train.steps=8", f"train.resume={step4}", "checkpoint.every_steps=2", ck("ckC"),
                                      "checkpoint.at_end=false"]},
        {"name": "cp_back", "overrides": LAYOUT + ["train.steps=8", f"train.resume={out / 'ckC' / 'step_00000006'}",
                                                   ck("ckC2"), "checkpoint.at_end=false"]},
        # HSDP: 2 replicas of 2 ZeRO-3 shards go on from the FSDP checkpoint of step 4 and save at 6; back again
        {"name": "hsdp", "overrides": ["parallel.zero_stage=3", "parallel.dp_replicate=2", "train.micro_batch_size=2",
                                       "train.steps=8", f"train.resume={step4}", "checkpoint.every_steps=2",
                                       ck("ckS"), "checkpoint.at_end=false"]},
        {"name": "hsdp_back", "overrides": LAYOUT + ["train.steps=8", ck("ckS2"), "checkpoint.at_end=false",
                                                     f"train.resume={out / 'ckS' / 'step_00000006'}"]},
        # CPU offload: dp4 ZeRO-3 with its shards in host memory goes on from step 4 and saves at 6; back again
        {"name": "offload", "overrides": ["parallel.zero_stage=3", "parallel.offload=all", "train.micro_batch_size=2",
                                          "train.steps=8", f"train.resume={step4}", "checkpoint.every_steps=2",
                                          ck("ckO"), "checkpoint.at_end=false"]},
        {"name": "host_adamw", "overrides": ["parallel.tp=2", "parallel.zero_stage=2", "parallel.offload=optimizer",
                                             "train.micro_batch_size=4", "train.steps=8", f"train.resume={step4}",
                                             "checkpoint.every_steps=2", ck("ckV"), "checkpoint.at_end=false"]},
        {"name": "host_adamw_back", "overrides": LAYOUT + ["train.steps=8", ck("ckV2"), "checkpoint.at_end=false",
                                                           f"train.resume={out / 'ckV' / 'step_00000006'}"]},
        {"name": "offload_back", "overrides": LAYOUT + ["train.steps=8", ck("ckO2"), "checkpoint.at_end=false",
                                                        f"train.resume={out / 'ckO' / 'step_00000006'}"]},
        # GPT's GeLU MLP: tp2 x dp2 ZeRO-3 saves at step 4, tp2 with sequence parallel, ZeRO-1 and op recompute goes on
        {"name": "gelu_full", "overrides": LAYOUT + GELU + ["train.steps=8", "checkpoint.every_steps=4", ck("ckL"),
                                                            "checkpoint.at_end=false"]},
        {"name": "gelu_to_tp2", "overrides": GELU + ["parallel.tp=2", "parallel.sequence_parallel=true",
                                                     "parallel.zero_stage=1", "train.micro_batch_size=4", "train.ac=op",
                                                     "train.steps=8", f"train.resume={gelu4}", ck("ckL2"),
                                                     "checkpoint.at_end=false"]},
        # tied embeddings: one process's layout saves at step 4; pp=2 x dp=2 ZeRO-1 (the last stage's copy and its
        # AdamW state saved under the embedding's name) goes on from it and saves at step 6; the first goes on
        {"name": "tied_full", "overrides": LAYOUT + TIED + ["train.steps=8", "checkpoint.every_steps=4", ck("ckT"),
                                                            "checkpoint.at_end=false"]},
        {"name": "tied_to_pp2", "overrides": TIED_PP + ["train.steps=8", f"train.resume={tied4}",
                                                        "checkpoint.every_steps=2", ck("ckT2"),
                                                        "checkpoint.at_end=false"]},
        {"name": "tied_back", "overrides": LAYOUT + TIED + ["train.steps=8", ck("ckT3"), "checkpoint.at_end=false",
                                                            f"train.resume={out / 'ckT2' / 'step_00000006'}"]},
        {"name": "async", "overrides": LAYOUT + ["train.steps=8", "checkpoint.every_steps=2",
                                                 "checkpoint.async_save=true", "checkpoint.keep=3", ck("ckF")]},
        # USR2 one step after an asynchronous save began: it is finished and committed, then step 3 is saved
        {"name": "async_first", "overrides": LAYOUT + ["train.steps=8", "checkpoint.every_steps=2",
                                                       "checkpoint.async_save=true", ck("ckG")], "preempt_at": 3},
        {"name": "async_resumed", "overrides": LAYOUT + ["train.steps=8", ck("ckG"), "checkpoint.at_end=false"]},
        # for the Hugging Face export: GQA, vocabulary 200 padded to 256, saved at the end (step 2)
        {"name": "hf", "overrides": LAYOUT + HF_MODEL + ["train.steps=2", ck("ckH")]},
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ckpt")
    cases = _cases(out)
    cmd = [sys.executable, str(WORKERS / "ckpt_worker.py"), str(out), json.dumps(cases),
           str(free_base_port(len(cases)))]
    procs = spawn_ranks(4, cmd, ranks_per_node=4, run_id="ckpt")  # one node: tp=4 must fit
    logs = [p.communicate(timeout=600)[0] for p in procs]
    errors = {}
    for f in out.glob("errors-rank*.json"):
        errors.update(json.loads(f.read_text()))
    assert not errors and all(p.returncode == 0 for p in procs), f"{errors}\n" + "\n".join(x[-3000:] for x in logs)
    return {"out": out} | {c["name"]: torch.load(out / f"{c['name']}.pt") for c in cases}


def test_same_layout_resume_is_bitwise(runs) -> None:
    # USR2 on one rank after step 4: every rank stopped there, with a committed checkpoint
    assert runs["first"]["preempted"] and runs["first"]["steps"] == 4 and runs["first"]["resumed_from"] is None
    assert runs["first"]["losses"] == runs["full"]["losses"][:4]
    assert runs["resumed"]["resumed_from"] == 4
    assert runs["resumed"]["losses"] == runs["full"]["losses"][4:]
    for k, v in runs["full"]["weights"].items():
        assert torch.equal(v, runs["resumed"]["weights"][k]), k


def test_usr2_during_async_save_resumes_bitwise(runs) -> None:
    first, resumed = runs["async_first"], runs["async_resumed"]
    assert first["preempted"] and first["steps"] == 3 and resumed["resumed_from"] == 3
    assert first["losses"] + resumed["losses"] == runs["full"]["losses"]
    assert [s for s, _ in committed(runs["out"] / "ckG")] == [2, 3]
    record("USR2 on one of 4 ranks while an asynchronous save is in flight", "the async save commits, step 3 "
           "is saved, the resumed run's losses are bitwise the uninterrupted run's", tier="multi-process")


def _continues_from_step4(got: dict, ref: dict, step: int = 4) -> None:
    """A run resumed at `step` in another layout: its losses to step 8 and final weights match the uninterrupted
    run's."""
    assert got["resumed_from"] == step and len(got["losses"]) == 8 - step
    assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"][step:])) <= LOSS_TOL
    assert set(got["weights"]) == set(ref["weights"])
    worst = max((got["weights"][k] - ref["weights"][k]).abs().max().item() for k in ref["weights"])
    assert worst <= WEIGHT_TOL


@pytest.mark.parametrize("layout", ["dp4", "tp4", "zero1_tp2"])
def test_reshard_on_load(runs, layout) -> None:
    _continues_from_step4(runs[layout], runs["full"])


def test_fused_projections_reshard_to_and_from_separate_ones(runs, tmp_path) -> None:
    """model.fused_projections changes no checkpoint key: a fused tp2 x dp2 ZeRO-1 run goes on from the separate
    projections' ZeRO-3 checkpoint, plain dp=4 ZeRO-3 (selective recompute) goes on from the fused run's, each the
    uninterrupted run;
    the fused run's checkpoint exports for transformers and computes its logits."""
    from hfcheck import LOGIT_TOL, logit_diff

    from hpctrain.hf.export import export_hf

    _continues_from_step4(runs["fused_tp2"], runs["full"])
    _continues_from_step4(runs["fused_to_dp4"], runs["full"], step=6)
    ckpt = runs["out"] / "ckU" / "step_00000008"
    export_hf(ckpt, tmp_path / "hf")
    assert logit_diff(tmp_path / "hf", ckpt, runs["fused_tp2"]["weights"], 48) <= LOGIT_TOL


def test_context_parallel_resumes_any_layout(runs) -> None:
    """A checkpoint written without cp goes on under cp = 2 (x dp 2, ZeRO-3), and the one it writes goes on
    without: cp holds no state of its own."""
    _continues_from_step4(runs["cp2"], runs["full"])
    _continues_from_step4(runs["cp_back"], runs["full"], step=6)


def test_hsdp_checkpoints_reshard(runs) -> None:
    """parallel.dp_replicate = 2 (HSDP) goes on from a plain FSDP checkpoint, and one it writes (each shard once,
    the replicas' copies not twice) goes on under FSDP with tp."""
    _continues_from_step4(runs["hsdp"], runs["full"])
    _continues_from_step4(runs["hsdp_back"], runs["full"], step=6)
    # each shard saved once: the size of plain ZeRO-3's step-6 checkpoint (offload's), not the replicas' twice
    size = lambda d: sum(f.stat().st_size for f in (runs["out"] / d / "step_00000006").rglob("*"))  # noqa: E731
    assert size("ckS") == pytest.approx(size("ckO"), rel=0.02)


def test_cpu_offload_checkpoints_reshard(runs) -> None:
    """parallel.offload = "all" saves and loads the same checkpoints: it goes on from one written without offload,
    and one it writes goes on without."""
    _continues_from_step4(runs["offload"], runs["full"])
    _continues_from_step4(runs["offload_back"], runs["full"], step=6)


def test_optimizer_offload_checkpoints_reshard(runs) -> None:
    """parallel.offload = "optimizer" (tp2 x dp2 ZeRO-2, AdamW on the host) goes on from a checkpoint written
    without it, its masters copied from the loaded weights, and writes one that goes on without."""
    _continues_from_step4(runs["host_adamw"], runs["full"])
    _continues_from_step4(runs["host_adamw_back"], runs["full"], step=6)


def test_gelu_mlp_reshards(runs) -> None:
    """A GeLU model's ZeRO-3 checkpoint goes on in tp2 x dp2 with sequence parallel, ZeRO-1 and op recompute, as the
    uninterrupted run."""
    _continues_from_step4(runs["gelu_to_tp2"], runs["gelu_full"])
    assert "layers.0.feed_forward.w3.weight" not in runs["gelu_full"]["weights"]


def test_tied_embeddings_reshard_across_pipeline_ranks(runs) -> None:
    _continues_from_step4(runs["tied_to_pp2"], runs["tied_full"])
    _continues_from_step4(runs["tied_back"], runs["tied_full"], step=6)
    w = runs["tied_to_pp2"]["weights"]
    assert torch.equal(w["output.weight"], w["tok_embeddings.weight"])


def test_zero1_with_tp_saves_a_reshardable_checkpoint(runs) -> None:
    _continues_from_step4(runs["zero1_to_dp4"], runs["full"], step=6)


def test_async_save_writes_what_sync_writes(runs) -> None:
    sync, asyn = runs["out"] / "ckB" / "step_00000004", runs["out"] / "ckF" / "step_00000004"
    assert (asyn / "COMMITTED").is_file()
    assert json.loads((asyn / "train_state.json").read_text())["step"] == 4
    shards = sorted(p.name for p in sync.glob("*.h5"))
    assert shards == sorted(p.name for p in asyn.glob("*.h5")) and len(shards) == 4
    assert_bitwise_equal(stored_datasets(sync), stored_datasets(asyn))  # every dataset: RNG table and JSON too


def test_keep_last_k(runs) -> None:
    steps = sorted(p.name for p in (runs["out"] / "ckF").iterdir())
    assert steps == ["step_00000004", "step_00000006", "step_00000008"]  # keep = 3; 8 is the final save
    assert sorted(p.name for p in (runs["out"] / "ckB").iterdir()) == ["step_00000004"]


def test_pipeline_same_layout_resume_is_bitwise(runs) -> None:
    assert runs["pp_resumed"]["resumed_from"] == 4
    assert runs["pp_resumed"]["losses"] == runs["pp_full"]["losses"][4:]
    assert set(runs["pp_resumed"]["weights"]) == set(runs["pp_full"]["weights"])  # every stage's weights
    for k, v in runs["pp_full"]["weights"].items():
        assert torch.equal(v, runs["pp_resumed"]["weights"][k]), k


@pytest.mark.parametrize("layout", ["pp_to_tp2dp2", "pp_to_pp4"])
def test_pipeline_checkpoint_reshards(runs, layout) -> None:
    _continues_from_step4(runs[layout], runs["pp_full"])


def test_pipeline_summary(runs) -> None:
    pipe = runs["pp_full"]["pipeline"]
    assert pipe["schedule"] == "1f1b" and pipe["microbatches"] == 4
    assert pipe["stage_layers"] == [[0, 1], [2, 3]]
    assert pipe["bubble_theory"] == pytest.approx(1 / 5)  # (p - 1) / (m + p - 1)
    assert [r["blocks"] for r in pipe["per_pp_rank"]] == [[0, 1], [2, 3]]
    for r in pipe["per_pp_rank"]:
        assert 0 < r["compute_s"] < r["step_s"] and 0 < r["idle_fraction"] < 1
    assert runs["pp_to_pp4"]["pipeline"]["stage_layers"] == [[0], [1], [2], [3]]
    assert runs["pp_to_tp2dp2"]["pipeline"] is None


def test_hf_export_from_tp2_dp2_zero3(runs, tmp_path) -> None:
    """The checkpoint of 4 ranks (tp=2 x dp=2, ZeRO-3) exported for transformers computes the trained logits."""
    from hfcheck import LOGIT_TOL, logit_diff

    from hpctrain.hf.export import export_hf

    ckpt, out = runs["out"] / "ckH" / "step_00000002", tmp_path / "hf"
    marker = json.loads((ckpt / "COMMITTED").read_text())
    assert marker["layout"] == {"pp": 1, "dp": 2, "tp": 2, "cp": 1, "replicate": 1, "zero_stage": 3}
    assert len(list(ckpt.glob("*.h5"))) == 4
    done = export_hf(ckpt, out)
    assert (done["vocab_size"], done["padded_vocab_size"], done["num_shards"]) == (200, 256, 1)
    diff = logit_diff(out, ckpt, runs["hf"]["weights"], 48)
    print(f"tp2 x dp2 ZeRO-3: max |logit diff| {diff:.2e}")
    assert diff <= LOGIT_TOL

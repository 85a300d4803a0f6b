"""The layouts of the multi-process equivalence suite (tests/multiproc/parallel/test_train_equivalence.py, eager;
test_train_equivalence_compiled.py, train.compile): each trains the tiny model of helpers.training for 8 steps and
must match a one-process reference run. TWO runs on 2 ranks, FOUR on 4; reference_of() names the one-process run a
layout is compared with (the same model: 4 blocks, tied embeddings, a GELU MLP, where the layout asks for one)."""
from __future__ import annotations

PP = ["parallel.pp=2", "train.micro_batch_size=2", "train.grad_accum=4"]
FOUR_LAYERS = ["model.n_layers=4"]  # 2 virtual stages on each of 2 ranks: a block per stage
FUSED = "model.fused_projections=true"
COMPILE = "train.compile=true"
TWO = [
    {"name": "tp2", "overrides": ["parallel.tp=2"]},
    {"name": "tp2_sp", "overrides": ["parallel.tp=2", "parallel.sequence_parallel=true"]},
    *[{"name": f"dp2_zero{z}", "overrides": [f"parallel.zero_stage={z}", "train.micro_batch_size=4"]}
      for z in range(4)],
    {"name": "dp2_zero3_bf16", "overrides": ["parallel.zero_stage=3", "train.micro_batch_size=4",
                                             "train.precision=bf16"]},
    {"name": "dp2_fp16_inf", "overrides": ["train.precision=fp16", "train.micro_batch_size=4"],
     "inject_inf_step": 3},
    # pipeline: 4 micro-batches of 2 per step, the reference's 8 sequences
    *[{"name": f"pp2_{sched}", "overrides": PP + [f"parallel.pp_schedule={sched}"]} for sched in ("gpipe", "1f1b")],
    {"name": "pp2_bf16", "overrides": PP + ["train.precision=bf16"]},
    # tied embeddings across pipeline ranks: the last stage's copy, its gradient summed with the embedding's
    {"name": "pp2_tied", "overrides": PP + ["parallel.pp_schedule=1f1b", "model.tie_embeddings=true"]},
    # partial recompute (train.ac selective, op): bitwise the same run as without
    *[{"name": f"tp2_sp_{ac}", "overrides": ["parallel.tp=2", "parallel.sequence_parallel=true", f"train.ac={ac}"]}
      for ac in ("selective", "op")],
    # GPT's two-matrix MLP (model.mlp = "gelu"): w1 column-, w2 row-parallel
    {"name": "tp2_sp_gelu", "overrides": ["parallel.tp=2", "parallel.sequence_parallel=true", "model.mlp=gelu"]},
    # fused projections (model.fused_projections): q/k/v and gate/up each one matmul over this rank's rows
    {"name": "tp2_fused", "overrides": ["parallel.tp=2", FUSED]},
    *[{"name": f"tp2_sp_fused{ac}", "overrides": ["parallel.tp=2", "parallel.sequence_parallel=true", FUSED]
       + (["train.ac=op"] if ac else [])} for ac in ("", "_op")],
    # context parallel: each rank an early and a late chunk of every sequence, ring attention over the pair
    {"name": "cp2", "overrides": ["parallel.cp=2"]},
    # CPU offload (FSDP's shards, gradients and AdamW state in host memory): on CPU the same run as without
    {"name": "dp2_zero3_offload", "overrides": ["parallel.zero_stage=3", "parallel.offload=all",
                                                "train.micro_batch_size=4"]},
    {"name": "dp2_zero0_host_adamw", "overrides": ["parallel.offload=optimizer", "train.micro_batch_size=4"]},
    # overlap settings: FSDP gathering 2 blocks ahead, DDP buckets of 2 MiB
    {"name": "dp2_zero3_prefetch2", "overrides": FOUR_LAYERS + ["parallel.zero_stage=3", "train.micro_batch_size=4",
                                                                "parallel.fsdp_prefetch=2"]},
    {"name": "dp2_zero0_bucket2", "overrides": ["train.micro_batch_size=4", "parallel.ddp_bucket_mb=2"]},
    {"name": "dp2_zero3_op", "overrides": ["parallel.zero_stage=3", "train.micro_batch_size=4", "train.ac=op"]},
    {"name": "pp2_1f1b_selective", "overrides": PP + ["parallel.pp_schedule=1f1b", "train.ac=selective"]},
    *[{"name": f"pp2v2_{sched}", "overrides": PP + FOUR_LAYERS + [f"parallel.pp_schedule={sched}",
                                                                   "parallel.pp_virtual_stages=2"]}
      for sched in ("interleaved_1f1b", "zbv")],
]
FOUR = [
    {"name": "tp2dp2_zero3", "overrides": ["parallel.tp=2", "parallel.zero_stage=3", "train.micro_batch_size=4"]},
    {"name": "tp2dp2_zero3_tied", "overrides": ["parallel.tp=2", "parallel.zero_stage=3", "train.micro_batch_size=4",
                                                "model.tie_embeddings=true"]},
    {"name": "tp2dp2_zero0", "overrides": ["parallel.tp=2", "parallel.zero_stage=0", "train.micro_batch_size=2",
                                           "train.grad_accum=2"]},
    # Megatron's distributed optimizer: AdamW state sharded over dp, parameters tp-sharded DTensors (sequence
    # parallel: the embedding's gradient arrives whole, not as the parameter's shard)
    {"name": "tp2dp2_zero1_sp", "overrides": ["parallel.tp=2", "parallel.sequence_parallel=true",
                                              "parallel.zero_stage=1", "train.micro_batch_size=2",
                                              "train.grad_accum=2"]},
    {"name": "tp2dp2_zero2_ac", "overrides": ["parallel.tp=2", "parallel.zero_stage=2", "train.micro_batch_size=4",
                                              "train.ac=every"]},
    {"name": "dp4_zero1_accum2", "overrides": ["parallel.zero_stage=1", "train.micro_batch_size=1",
                                               "train.grad_accum=2"]},
    {"name": "pp2tp2", "overrides": PP + ["parallel.tp=2"]},
    {"name": "pp2tp2_fused", "overrides": PP + ["parallel.tp=2", FUSED]},
    # context parallel 4 (the ring takes 3 hops), with tp and sequence parallel, dp ZeRO-3, a pipeline, recompute
    {"name": "cp4_selective", "overrides": ["parallel.cp=4", "train.ac=selective"]},
    {"name": "cp2tp2_sp", "overrides": ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]},
    {"name": "cp2dp2_zero3", "overrides": ["parallel.cp=2", "parallel.zero_stage=3", "train.micro_batch_size=4"]},
    {"name": "cp2pp2", "overrides": PP + ["parallel.cp=2"]},
    {"name": "tp2dp2_zero2_offload", "overrides": ["parallel.tp=2", "parallel.zero_stage=2", "parallel.offload=all",
                                                   "train.micro_batch_size=4"]},
    {"name": "pp2dp2_zero2_offload", "overrides": PP + ["parallel.zero_stage=2", "parallel.offload=all",
                                                        "train.micro_batch_size=1"]},
    {"name": "tp2dp2_zero3_host_adamw", "overrides": ["parallel.tp=2", "parallel.zero_stage=3",
                                                      "parallel.offload=optimizer", "train.micro_batch_size=4"]},
    # HSDP: 2 replicas of 2 shards (reduce-scatter in the shard pair, all-reduce across the replicas), with
    # accumulation under ZeRO-2
    {"name": "dp4_zero3_hsdp2", "overrides": ["parallel.zero_stage=3", "parallel.dp_replicate=2",
                                              "train.micro_batch_size=2"]},
    {"name": "dp4_zero2_hsdp2_accum2", "overrides": ["parallel.zero_stage=2", "parallel.dp_replicate=2",
                                                     "train.micro_batch_size=1", "train.grad_accum=2"]},
    {"name": "tp2dp2_zero1_sp_fused", "overrides": ["parallel.tp=2", "parallel.sequence_parallel=true",
                                                    "parallel.zero_stage=1", "train.micro_batch_size=2",
                                                    "train.grad_accum=2", FUSED]},
    {"name": "pp2tp2_tied", "overrides": PP + ["parallel.tp=2", "model.tie_embeddings=true"]},
    {"name": "pp2dp2_zero3_tied", "overrides": PP + ["parallel.zero_stage=3", "train.micro_batch_size=1",
                                                     "model.tie_embeddings=true"]},
    *[{"name": f"pp2dp2_zero{z}", "overrides": PP + [f"parallel.zero_stage={z}", "train.micro_batch_size=1"]}
      for z in (0, 3)],
    {"name": "pp4_gpipe", "overrides": PP + FOUR_LAYERS + ["parallel.pp=4", "parallel.pp_schedule=gpipe"]},
    {"name": "pp2v2dp2_interleaved_zero1_ac", "overrides": PP + FOUR_LAYERS + [
        "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2", "parallel.zero_stage=1",
        "train.micro_batch_size=1", "train.ac=full"]},
    {"name": "pp2v2dp2_zbv_zero2", "overrides": PP + FOUR_LAYERS + [
        "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=2", "parallel.zero_stage=2",
        "train.micro_batch_size=1"]},
]


def reference_of(overrides: list[str]) -> str:
    """The one-process run a layout trains the same model as (the eager fixture's file stem)."""
    if any(o.startswith("model.n_layers=4") for o in overrides):
        return "ref4"
    if "model.tie_embeddings=true" in overrides:
        return "ref_tied"
    if "model.mlp=gelu" in overrides:
        return "ref_gelu"
    return "ref"

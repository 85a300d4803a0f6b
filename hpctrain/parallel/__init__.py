"""One module per parallelism (pipeline, tensor, data/ZeRO), activation recomputation and materialisation;
compose.build applies them in a fixed order. This package's own module stays empty: hpctrain.parallel.plan imports
parallel.pipeline, which must not pull the composition (and the plan) in with it."""

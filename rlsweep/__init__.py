"""rlsweep: sweeps lm_head logprob kernels for accuracy, layout/TP invariance and provenance."""

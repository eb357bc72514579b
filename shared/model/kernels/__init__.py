"""The model's own Triton kernels: the batch-1 GEMVs (with their launch table,
gemv_configs.json) and the fused elementwise ops."""

"""Pure-torch building blocks every family shares: config parsing, attention, decoder, MLP, norms, RoPE,
KV cache, loss, hub layouts, default-plan pieces and single-process generation."""

"""DeepSeek-V3.2-style sparse-attention (DSA) model in torch (ring 2)."""

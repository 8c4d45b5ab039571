"""Model pieces the rankers share (encoders, kernels, losses, sparse attention, checkpoints)."""

# the BERT-sized encoder CLEAR, CEDR and QDS-Transformer start from (Hugging Face id)
DEFAULT_ENCODER = "sentence-transformers/all-MiniLM-L6-v2"

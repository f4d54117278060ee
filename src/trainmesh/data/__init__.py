"""Data: corpora, tokenizers, datasets and world-size-independent sharding."""

"""hf_selfspec: exact self-speculative decoding for Hugging Face generate()."""

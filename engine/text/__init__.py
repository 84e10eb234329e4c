"""The text layer: tokenizer, incremental detokenizer, chat templates and the model-specific prompt and
answer formats (DeepSeek-V3.2's DSML encoder, gpt-oss's harmony channels)."""

"""OpenAI's Files and Batches: uploaded JSONL, batch state, and the lines' execution."""

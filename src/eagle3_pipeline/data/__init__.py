"""Chat data in: readers for the input formats, the chat template and loss masks, tokenization."""

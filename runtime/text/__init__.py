"""Text in and out of the engine: the tokenizer and incremental detokenizer, chat prompts and suites, grammars."""

"""enginesim: a stand-in for vLLM's OpenAI server, with a timing model of a real engine."""

"""Tool calling: the tool-call formats of model families (grammar and parser), and the parser of a streamed output."""

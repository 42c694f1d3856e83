"""Structured output: decoding constrained by a JSON schema, a regex, a choice or a grammar.

spec.py      StructuredOutput, what a request asks for (it crosses the KV hand-off with the
             request's SamplingParams)
backend.py   the interface a grammar library implements (compile, match, fill a bitmask)
xgrammar_backend.py   that interface on xgrammar
grammars.py  the engine's side: compiled grammars cached off the step loop, one matcher per
             request rebuilt from its accepted tokens, the batch's bitmask applied at once
"""

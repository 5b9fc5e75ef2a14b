"""``kvpool gateway``: an OpenAI-compatible HTTP gateway that routes each request to the engine
where its prompt's KV is cheapest to get (the master's Route), in front of N engines.

Modules: ``engines`` (the engines and their load, sans-IO), ``prompts`` (the model's tokenizer
and chat template), ``routing`` (Route, or least loaded without the master), ``upstream`` (one
try on one engine, streams passed through), ``probes`` (engine load and health), ``metrics``,
``server`` (the aiohttp app). Needs the ``gateway`` extra (aiohttp, transformers); nothing
imports this package but the command line.
"""

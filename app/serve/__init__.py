"""``srl serve``: an OpenAI-compatible HTTP server whose every completion is also training data.

One engine (the generator's: hf, sim, vllm) behind ``POST /v1/completions`` and
``POST /v1/chat/completions``, following the run's weights like a generator worker; each served
choice is published, chunk by chunk, to ``{prefix}.trajectories`` exactly like dispatched work
(source ``serve``). docs/serving.md is the user's guide. Modules, from the wire inwards:

* ``app.configs.ServeConfig``: the settings (the ``[serve]`` table);
* ``protocol``: OpenAI request models, validation, response bodies and chunks (pure);
* ``http``: the FastAPI app (keys, body limit, disconnects) and the bridge to the engine
  thread; ``metrics``: its Prometheus ``/metrics``;
* ``jobs``: what crosses between them (a job and its events);
* ``core``: the engine thread (continuous batching over every request, fair-share slots, a
  queue-wait bound; one request never stops it); ``upkeep``: its weight swaps, loss counters
  and metric events;
* ``text``: detokenization, stop strings, chat prompts, logprobs' token texts (pure);
* ``publish``: served choices as trajectory chunks (never blocking: drop and count);
* ``run``: the process (engine, follower, producer, uvicorn).
"""

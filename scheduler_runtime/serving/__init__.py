"""The serving layer: Feather inside vLLM, ``feather-serve``, and several engines behind one endpoint.

Everything that imports vLLM, Ray or an HTTP server lives here, above the engine-free core
(:mod:`scheduler_runtime`), which imports none of them (``tests/test_layers.py`` checks that by import):

* :mod:`~scheduler_runtime.serving.vllm_scheduler`: ``FeatherScheduler`` / ``FeatherAsyncScheduler``,
  vLLM V1's scheduler with the core's decisions (``--scheduler-cls scheduler_runtime.FeatherScheduler``);
* :mod:`~scheduler_runtime.serving.metrics`: their Prometheus counters;
* :mod:`~scheduler_runtime.serving.serve`: the ``feather-serve`` command;
* :mod:`~scheduler_runtime.serving.admission_http`: ``feather-serve --admission``'s middleware in
  vLLM's API server (the rules of :mod:`scheduler_runtime.admission`, decided before any byte);
* :mod:`~scheduler_runtime.serving.cluster_base`, :mod:`~scheduler_runtime.serving.proxy`,
  :mod:`~scheduler_runtime.serving.cluster`, :mod:`~scheduler_runtime.serving.ray_router`:
  ``feather-serve --replicas N`` on its two data planes (a local proxy, or Ray Serve).
"""

"""``tuneport serve --on ray``: the gateway, the adapter pools and the engines as one Ray Serve application.

- :mod:`.config`: the application's deployments and their Ray settings, the Serve config file and the KubeRay
  ``RayService`` manifest (no Ray import);
- :mod:`.catalog`: the adapters an admin loaded, and what each replica reports (one small deployment);
- :mod:`.replica`: one engine and its adapter pool per replica; a request's adapter is its multiplexed model id;
- :mod:`.router`: the :class:`~tuneport.serve.backend.Backend` the ingress's gateway answers through;
- :mod:`.app`: the application builder (``import_path`` of the Serve config);
- :mod:`.server`: start or join a cluster, deploy, serve until stopped;
- :mod:`.proxy`: tuneport's HTTP limits in Ray Serve's own proxy (Ray's proxy callback).
"""

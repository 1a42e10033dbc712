"""Engine replicas behind one OpenAI endpoint on Ray Serve (``kvledger serve --data-parallel-size N``).

:mod:`.router` is the prefix-affinity request router (Ray Serve's ``RequestRouter`` interface),
:mod:`.deployment` the two deployments (an ingress that reads each request's prompt, and the
engine replicas, each running the ordinary server app in-process), :mod:`.launch` start-up and
shutdown. Ray is the optional extra ``kvledger[cluster]``.
"""

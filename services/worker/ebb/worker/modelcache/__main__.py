"""`python -m ebb.worker.modelcache`: the node's model cache server."""

from .server import main

raise SystemExit(main())

"""`python -m ebb.worker.modelcache`: the node's model cache server."""

from .command import main

raise SystemExit(main())

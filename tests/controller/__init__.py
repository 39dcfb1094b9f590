"""The controller: its pure policies, the reconcile step, the local backend with real processes.
The Kubernetes backend against a fake API server is in tests/k8s."""

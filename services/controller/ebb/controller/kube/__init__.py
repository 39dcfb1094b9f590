"""The Kubernetes backend: workers as pods (`backend`), its settings (`config`), its caches
of nodes and pods (`informer`, read through `views`), the pod spec (`podspec`) and where a
pod may go (`placement`, `placer`), each worker's NATS credential as a Secret
(`credentials`), and the tide's work on the mixed pool (`harvest`)."""

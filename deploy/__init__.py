"""How Tandem starts: the local supervisor (`tandem up`), Envoy and Kubernetes configuration."""

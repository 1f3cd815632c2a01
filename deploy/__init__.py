"""How Tandem starts: the local suite (``suite_plan``: what ``tandem up`` starts;
``supervisor``: running it), Envoy's configuration (``envoy_config``, ``envoy_runner``),
Kubernetes manifests (``k8s``, ``render``) and the suite's throwaway certificate authority
(``local_ca``). It sits on top: it may import every other package; nothing imports it."""

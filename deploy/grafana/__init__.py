"""The suite's Grafana dashboard (``dashboard`` renders ``tandem.json``)."""

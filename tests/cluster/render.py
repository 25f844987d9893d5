#!/usr/bin/env python3
"""Renders charts/preheat with Helm's own Go SDK (helm-python-sdk) for the values in the
JSON file given as the only argument (release "rel", namespace "llm"), and prints every
rendered object as one JSON list: what `helm install` would send to the API server."""

import json
import os
import sys

import helm_python
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

with open(sys.argv[1]) as f:
    values = json.load(f)
# PREHEAT_CHART_DIR: another copy of the chart (e.g. an older commit's, to show what
# the cluster run catches there).
chart = os.environ.get("PREHEAT_CHART_DIR") or os.path.join(ROOT, "charts", "preheat")
rendered = helm_python.Chart.load(chart).render(
    values, name="rel", namespace="llm", is_install=True
)
objs = []
for path, text in sorted(rendered.items()):
    if path.endswith(".txt"):
        continue
    objs.extend(d for d in yaml.safe_load_all(text) if d)
json.dump(objs, sys.stdout)

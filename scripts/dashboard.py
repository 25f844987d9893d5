#!/usr/bin/env python3
"""Writes charts/preheat/dashboards/preheat.json (the Grafana dashboard the chart ships):
`python3 scripts/dashboard.py > charts/preheat/dashboards/preheat.json`. Panels and
queries are kept here; tests/cli_up.rs runs every query against a real Prometheus."""
import json
DS = {"type": "prometheus", "uid": "${datasource}"}
E = 'namespace=~"$namespace", model_name=~"$model", role=~"$pool"'   # engines
S = 'namespace=~"$namespace", model=~"$model", pool=~"$pool"'         # scaler
W = 'namespace=~"$namespace"'                                          # agents, gateway
panels = []
y = 0
pid = 0
def nid():
    global pid
    pid += 1
    return pid
def row(title):
    global y
    panels.append({"type": "row", "title": title, "id": nid(), "collapsed": False,
                   "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
    y += 1
slot = [0]
def panel(kind, title, desc, targets, unit=None, w=8, h=8, extra=None, overrides=None):
    global y
    x = slot[0]
    if x + w > 24:
        x = 0
        y += h
    p = {"type": kind, "title": title, "description": desc, "id": nid(), "datasource": DS,
         "gridPos": {"h": h, "w": w, "x": x, "y": y},
         "targets": [dict({"refId": chr(65 + i), "datasource": DS}, **t) for i, t in enumerate(targets)],
         "fieldConfig": {"defaults": {}, "overrides": overrides or []},
         "options": {}}
    if unit:
        p["fieldConfig"]["defaults"]["unit"] = unit
    if kind == "timeseries":
        p["options"] = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "none"}}
    if extra:
        for k, v in extra.items():
            p[k] = v
    panels.append(p)
    slot[0] = x + w
def endrow(h=8):
    global y
    y += h
    slot[0] = 0
def t(expr, legend, **kw):
    d = {"expr": expr, "legendFormat": legend}
    d.update(kw)
    return d
right = lambda name, unit: {"matcher": {"id": "byRegexp", "options": name},
                            "properties": [{"id": "custom.axisPlacement", "value": "right"},
                                           {"id": "unit", "value": unit}]}
dashed = lambda name: {"matcher": {"id": "byRegexp", "options": name},
                       "properties": [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                                      {"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}}]}
RI = "$__rate_interval"

row("SLO")
for slo, metric, title in [("ttft", "vllm:time_to_first_token_seconds", "Time to first token"),
                           ("itl", "vllm:inter_token_latency_seconds", "Inter-token latency")]:
    panel("timeseries", f"{title} p50 / p99 against target",
          f"Quantiles of {metric} per pool over the rate interval; the dashed line is the target the scaler sizes the pool for.",
          [t(f'histogram_quantile(0.5, sum by (le, role) (rate({metric}_bucket{{{E}}}[{RI}])))', "{{role}} p50"),
           t(f'histogram_quantile(0.99, sum by (le, role) (rate({metric}_bucket{{{E}}}[{RI}])))', "{{role}} p99"),
           t(f'max by (pool) (preheat:scaler_slo_target_seconds{{{S}, slo="{slo}"}})', "{{pool}} target")],
          unit="s", overrides=[dashed(".*target")])
panel("timeseries", "SLO attainment",
      "Share of the scaler's window of requests (ttft) or tokens (itl) within the target, per pool.",
      [t(f'max by (pool, slo) (preheat:scaler_slo_attainment_ratio{{{S}}})', "{{pool}} {{slo}}")],
      unit="percentunit", extra={"fieldConfig": {"defaults": {"unit": "percentunit", "min": 0, "max": 1}, "overrides": []}})
endrow()
panel("timeseries", "Requests held at the gateway",
      "Requests the gateways hold while a pool is at zero or has no ready worker; they are answered once a replica is up.",
      [t(f'sum by (pool) (preheat:gateway_pending_requests{{{W}}})', "held for {{pool}}")], w=12)
panel("timeseries", "Finished requests",
      "Requests finished per second by reason (stop, length, abort) and pool.",
      [t(f'sum by (role, finished_reason) (rate(vllm:request_success_total{{{E}}}[{RI}]))', "{{role}} {{finished_reason}}")],
      unit="reqps", w=12)
endrow()

row("Load")
panel("timeseries", "Tokens per second",
      "Prompt tokens prefilled and tokens generated per second, per pool.",
      [t(f'sum by (role) (rate(vllm:prompt_tokens_total{{{E}}}[{RI}]))', "{{role}} prompt"),
       t(f'sum by (role) (rate(vllm:generation_tokens_total{{{E}}}[{RI}]))', "{{role}} generation")],
      unit="short", w=6)
panel("timeseries", "Running and waiting sequences",
      "Sequences in the running batches and waiting to be scheduled, per pool.",
      [t(f'sum by (role) (vllm:num_requests_running{{{E}}})', "{{role}} running"),
       t(f'sum by (role) (vllm:num_requests_waiting{{{E}}})', "{{role}} waiting")], w=6)
panel("timeseries", "KV-cache usage",
      "Mean and highest fraction of KV-cache blocks in use over a pool's replicas, and the mean "
      "share of decode blocks reserved for K/V still at prefill (a prefill backlog, not decode load).",
      [t(f'avg by (role) (vllm:kv_cache_usage_perc{{{E}}})', "{{role}} mean"),
       t(f'max by (role) (vllm:kv_cache_usage_perc{{{E}}})', "{{role}} max"),
       t(f'avg by (role) (preheat:kv_cache_reserved_perc{{{E}}})', "{{role}} mean reserved for K/V at prefill")],
      unit="percentunit", w=6)
panel("timeseries", "Prefix-cache hit rate",
      "Prompt tokens found in the prefix cache over prompt tokens looked up, per pool.",
      [t(f'sum by (role) (rate(vllm:prefix_cache_hits_total{{{E}}}[{RI}])) / sum by (role) (rate(vllm:prefix_cache_queries_total{{{E}}}[{RI}]))', "{{role}}")],
      unit="percentunit", w=6)
endrow()

row("Scaler")
panel("timeseries", "Replicas: desired, current, ready",
      "What the scaler asks KEDA for, what the pool has, and what serves, per pool.",
      [t(f'max by (pool) (preheat:scaler_desired_replicas{{{S}}})', "{{pool}} desired"),
       t(f'max by (pool) (preheat:scaler_current_replicas{{{S}}})', "{{pool}} current"),
       t(f'max by (pool) (preheat:scaler_ready_replicas{{{S}}})', "{{pool}} ready")], w=8)
panel("state-timeline", "Decisions and why",
      "The reason of each pool's last decision over time (scale up, steady, deferred scale-down, idle, held while blind).",
      [t(f'max by (pool, reason) (preheat:scaler_decision{{{S}}}) == 1', "{{pool}}: {{reason}}")], w=8)
panel("timeseries", "Blind pools and failing endpoints",
      "1 while every metrics endpoint of a pool fails (the pool is held, not sized); endpoints that failed the last scrape.",
      [t(f'max by (pool) (preheat:scaler_blind{{{S}}})', "{{pool}} blind"),
       t(f'sum by (pool) (preheat:scaler_endpoints{{{S}, state="failed"}})', "{{pool}} failing endpoints")], w=8)
endrow()
panel("timeseries", "Forecast vs actual load",
      "A pool's load now and forecast one lead time (a replica's start-up) ahead: uncached prompt tokens/s for prefill, generated tokens/s for decode.",
      [t(f'max by (pool) (preheat:scaler_load{{{S}, kind="observed"}})', "{{pool}} observed"),
       t(f'max by (pool) (preheat:scaler_load{{{S}, kind="forecast"}})', "{{pool}} forecast")],
      overrides=[dashed(".*forecast")], w=12)
panel("timeseries", "Needed replicas and lead time",
      "Replicas the load needs before limits, rounding and damping; the lead time the forecast looks ahead.",
      [t(f'max by (pool) (preheat:scaler_needed_replicas{{{S}}})', "{{pool}} needed"),
       t(f'max by (pool) (preheat:scaler_lead_seconds{{{S}}})', "{{pool}} lead (s)")],
      overrides=[right(".*lead.*", "s")], w=12)
endrow()

row("Starts")
panel("bargauge", "Start-up phases by source",
      "Mean seconds from a replica's start (process start, or promotion of a standby) to the end of each phase, by how it started (convert, staged, hot, standby). Phases are cumulative (each bar ends where its phase ended), so they are drawn side by side rather than stacked.",
      [t(f'avg by (source, phase) (preheat:startup_phase_seconds{{{E}}})', "{{source}} {{phase}}", instant=True, format="time_series")],
      unit="s", w=8, extra={"options": {"orientation": "horizontal", "displayMode": "gradient", "showUnfilled": True,
                                         "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}})
panel("table", "Last starts",
      "The ten most recent starts of replicas now running: when, how, and seconds to their first token.",
      [t(f'topk(10, max by (instance, role) (preheat:replica_start_time_seconds{{{E}}})) * 1000', "", instant=True, format="table"),
       t(f'max by (instance, role, source) (preheat:startup_phase_seconds{{{E}, phase="first_token"}}) and on (instance) topk(10, max by (instance) (preheat:replica_start_time_seconds{{{E}}}))', "", instant=True, format="table")],
      w=8, extra={"transformations": [{"id": "merge", "options": {}},
                                      {"id": "organize", "options": {"excludeByName": {"Time": True},
                                                                     "renameByName": {"Value #A": "started", "Value #B": "first token (s)"}}},
                                      {"id": "sortBy", "options": {"sort": [{"field": "started", "desc": True}]}}],
                  "fieldConfig": {"defaults": {}, "overrides": [
                      {"matcher": {"id": "byName", "options": "started"}, "properties": [{"id": "unit", "value": "dateTimeAsIso"}]},
                      {"matcher": {"id": "byName", "options": "first token (s)"}, "properties": [{"id": "unit", "value": "s"}]}]}})
panel("timeseries", "Standbys: parked and promoted",
      "Standby replicas parked by the warm-pool agents, and replicas now serving that started as a promoted standby.",
      [t(f'sum by (pool) (preheat:warmpool_parked_standbys{{{W}}})', "{{pool}} parked"),
       t(f'count by (role) (preheat:startup_phase_seconds{{{E}, phase="first_token", source="standby"}})', "{{role}} promoted, serving")], w=8)
endrow()

row("Warm pool")
panel("timeseries", "Staged and hot models per node",
      "Models published on each node's disk, and those of the hot set held in page cache.",
      [t(f'max by (node, instance) (preheat:warmpool_staged_models{{{W}}})', "{{node}} staged"),
       t(f'max by (node, instance) (preheat:warmpool_hot_models{{{W}}})', "{{node}} hot")], w=6)
panel("timeseries", "Bytes per node",
      "Published snapshot bytes against the disk budget, and hot-set bytes resident in page cache.",
      [t(f'max by (node, instance) (preheat:warmpool_staged_bytes{{{W}}})', "{{node}} staged"),
       t(f'max by (node, instance) (preheat:warmpool_disk_budget_bytes{{{W}}})', "{{node}} disk budget"),
       t(f'sum by (node, instance) (preheat:warmpool_resident_bytes{{{W}}})', "{{node}} resident")],
      unit="bytes", w=6)
panel("timeseries", "Staging progress and throughput",
      "Progress of each model's staging (1 once published) and the throughput of its last staging.",
      [t(f'max by (node, model) (preheat:warmpool_staging_progress_ratio{{{W}}})', "{{node}} {{model}} progress"),
       t(f'max by (node, model) (preheat:warmpool_staging_throughput_bytes_per_second{{{W}}})', "{{node}} {{model}} B/s")],
      unit="percentunit", overrides=[right(".*B/s", "Bps")], w=6)
panel("timeseries", "Evictions and staging failures",
      "Snapshots evicted for the disk budget and stagings that failed, per node, over the rate interval.",
      [t(f'sum by (node, instance) (increase(preheat:warmpool_evictions_total{{{W}}}[{RI}]))', "{{node}} evictions"),
       t(f'sum by (node, model) (increase(preheat:warmpool_staging_failures_total{{{W}}}[{RI}]))', "{{node}} {{model}} failures")], w=6)
endrow()

def var_query(name, label, q, multi, all_):
    return {"name": name, "label": label, "type": "query", "datasource": DS,
            "query": {"query": q, "refId": f"{name}-var"}, "definition": q,
            "refresh": 2, "multi": multi, "includeAll": all_, "sort": 1,
            "current": {}, "options": [], "hide": 0}
dash = {
    "title": "preheat",
    "uid": "preheat-overview",
    "description": "Disaggregated LLM serving with preheat: SLOs, load, the scaler's decisions, replica starts and the warm pool.",
    "tags": ["preheat", "llm", "keda"],
    "editable": True,
    "graphTooltip": 1,
    "schemaVersion": 41,
    "version": 1,
    "refresh": "30s",
    "time": {"from": "now-3h", "to": "now"},
    "timezone": "browser",
    "annotations": {"list": []},
    "links": [],
    "templating": {"list": [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0, "refresh": 1, "options": [], "regex": ""},
        var_query("namespace", "Namespace", "label_values(preheat:scaler_current_replicas, namespace)", False, False),
        var_query("model", "Model", 'label_values(preheat:scaler_current_replicas{namespace=~"$namespace"}, model)', True, True),
        {"name": "pool", "label": "Pool", "type": "custom", "query": "prefill,decode",
         "multi": True, "includeAll": True, "hide": 0,
         "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
         "options": [{"selected": True, "text": "All", "value": "$__all"},
                     {"selected": False, "text": "prefill", "value": "prefill"},
                     {"selected": False, "text": "decode", "value": "decode"}]},
    ]},
    "panels": panels,
}
print(json.dumps(dash, indent=2))

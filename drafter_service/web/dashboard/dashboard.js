/* drafter dashboard: polls /api/series and keeps six uPlot charts and the current figures up to date. */
(function () {
  "use strict";

  var POLL_MS = 2000;          // how often new points are fetched
  var MAX_POINTS = 1500;       // the first load of a window is merged down to about this many points
  var FIGURE_SPAN_MS = 30000;  // the header's figures sum the points of the last 30 s
  var SUMMED = ["interval_s", "drafts", "drafted_tokens", "confirmed_tokens", "accepted_steps", "accepted_tokens",
                "speedup_steps", "speedup_tokens", "speedup_step_seconds", "speedup_plain_seconds"];
  var SOURCE_ORDER = ["session", "store", "dynamic", "frozen", "model", "repeat", "unspecified"];
  var SOURCE_COLORS = {
    session: "#2f6fdf", store: "#1a8f4c", dynamic: "#e07b00", frozen: "#8a4fd0",
    model: "#c62f2f", repeat: "#0f9fb0", unspecified: "#7d8597"
  };
  var MUTED = "#5d6577", GRID = "#e9ecf1";

  // Everything the page knows; exposed for tests and for poking at from the console.
  var state = {
    namespace: "", windowS: 3600, points: [], lastT: 0, plots: {}, sources: [],
    polls: 0, errors: 0, generation: 0, timer: null, ready: false
  };
  window.drafterDashboard = state;

  function byId(id) { return document.getElementById(id); }

  function fixed(digits) {
    return function (u, vals) { return vals.map(function (v) { return v == null ? "" : v.toFixed(digits); }); };
  }

  function compact(u, vals) {
    return vals.map(function (v) {
      if (v == null) { return ""; }
      var a = Math.abs(v);
      if (a >= 1e9) { return (v / 1e9).toFixed(1) + "G"; }
      if (a >= 1e6) { return (v / 1e6).toFixed(1) + "M"; }
      if (a >= 1e3) { return (v / 1e3).toFixed(a >= 1e4 ? 0 : 1) + "k"; }
      return String(Math.round(v * 100) / 100);
    });
  }

  function percent(u, vals) {
    return vals.map(function (v) { return v == null ? "" : Math.round(v * 100) + "%"; });
  }

  function pad(n) { return n < 10 ? "0" + n : String(n); }

  // Time ticks on one line: hh:mm:ss for short spans, hh:mm for longer ones, with the date past a day.
  function clock(u, splits, axisIdx, space, incr) {
    var span = splits.length > 1 ? splits[splits.length - 1] - splits[0] : 0;
    return splits.map(function (s) {
      var d = new Date(s * 1000);
      var hm = pad(d.getHours()) + ":" + pad(d.getMinutes());
      if (span > 2 * 86400) { return (d.getMonth() + 1) + "/" + d.getDate() + " " + hm; }
      return incr < 60 ? hm + ":" + pad(d.getSeconds()) : hm;
    });
  }

  function fromZero(floor) {
    return function (u, min, max) { return [0, Math.max(floor, (max || 0) * 1.12)]; };
  }

  // One entry per chart: its element, y axis, and the series drawn from each point.
  var CHARTS = {
    speedup: {
      el: "plot-speedup", values: fixed(1), range: fromZero(2), legend: false,
      series: function () {
        return [
          {label: "speedup", stroke: "#2f6fdf", width: 2, fill: "rgba(47,111,223,0.10)",
           get: function (p) { return p.speedup; }},
          {label: "plain decoding", stroke: "#9aa3b5", width: 1, dash: [5, 5], get: function () { return 1; }}
        ];
      }
    },
    mat: {
      el: "plot-mat", values: fixed(1), range: fromZero(2), legend: false,
      series: function () {
        return [{label: "MAT", stroke: "#1a8f4c", width: 2, fill: "rgba(26,143,76,0.10)",
                 get: function (p) { return p.mat; }}];
      }
    },
    acceptance: {
      el: "plot-acceptance", values: percent, range: function () { return [0, 1]; }, legend: true,
      series: function () {
        var out = [{label: "all", stroke: "#1d2330", width: 2, get: function (p) { return p.acceptance; }}];
        state.sources.forEach(function (src) {
          out.push({label: src, stroke: SOURCE_COLORS[src] || "#7d8597", width: 1.5,
                    get: function (p) {
                      var v = p.acceptance_by_source && p.acceptance_by_source[src];
                      return v == null ? null : v;
                    }});
        });
        return out;
      }
    },
    rate: {
      el: "plot-rate", values: compact, range: fromZero(1), legend: false,
      series: function () {
        return [{label: "drafts/s", stroke: "#e07b00", width: 2, fill: "rgba(224,123,0,0.10)",
                 get: function (p) { return p.drafts_per_s; }}];
      }
    },
    latency: {
      el: "plot-latency", values: compact, range: fromZero(10), legend: true,
      series: function () {
        return [
          {label: "p50", stroke: "#2f6fdf", width: 2, get: function (p) { return p.latency_p50_us; }},
          {label: "p99", stroke: "#c62f2f", width: 1.5, get: function (p) { return p.latency_p99_us; }}
        ];
      }
    },
    store: {
      el: "plot-store", values: compact, range: fromZero(10), legend: false,
      series: function () {
        return [{label: "tokens", stroke: "#8a4fd0", width: 2, fill: "rgba(138,79,208,0.10)",
                 get: function (p) { return p.stored_tokens; }}];
      }
    }
  };

  function chartSize(name) {
    var box = byId(CHARTS[name].el);
    var plot = state.plots[name];
    var legend = plot ? plot.root.querySelector(".u-legend") : null;
    var legendH = legend ? legend.offsetHeight : 0;
    return {width: Math.max(120, box.clientWidth), height: Math.max(100, box.clientHeight - legendH)};
  }

  function build(name) {
    var chart = CHARTS[name];
    var box = byId(chart.el);
    if (state.plots[name]) { state.plots[name].destroy(); }
    box.querySelectorAll(".uplot").forEach(function (n) { n.remove(); });
    chart.current = chart.series();
    var size = chartSize(name);
    var opts = {
      width: size.width, height: size.height,
      legend: {show: chart.legend, live: true},
      cursor: {drag: {x: true, y: false}},
      scales: {x: {time: true}, y: {range: chart.range}},
      axes: [
        {stroke: MUTED, grid: {stroke: GRID, width: 1}, ticks: {stroke: GRID, width: 1}, font: "12px system-ui",
         values: clock, space: 64, size: 32},
        {stroke: MUTED, grid: {stroke: GRID, width: 1}, ticks: {stroke: GRID, width: 1}, size: 52,
         values: chart.values, font: "12px system-ui"}
      ],
      series: [{}].concat(chart.current.map(function (s) {
        return {label: s.label, stroke: s.stroke, width: s.width, fill: s.fill, dash: s.dash, spanGaps: true,
                points: {size: 4}};
      }))
    };
    state.plots[name] = new uPlot(opts, dataOf(name), box);
    fit(name);
  }

  // Size a chart to its box less its legend. uPlot lays out on the next frame and the legend's height depends
  // on the width, so measure again after each change (a few frames at most).
  function fit(name, pass) {
    var plot = state.plots[name];
    if (!plot) { return; }
    var size = chartSize(name);
    if (size.width === plot.width && size.height === plot.height) { return; }
    plot.setSize(size);
    if ((pass || 0) < 4) {
      requestAnimationFrame(function () { if (state.plots[name] === plot) { fit(name, (pass || 0) + 1); } });
    }
  }

  function dataOf(name) {
    var xs = state.points.map(function (p) { return p.t / 1000; });
    return [xs].concat(CHARTS[name].current.map(function (s) {
      return state.points.map(function (p) { var v = s.get(p); return v == null ? null : v; });
    }));
  }

  function sourcesIn(points) {
    var seen = {};
    points.forEach(function (p) {
      Object.keys(p.drafted_by_source || {}).forEach(function (s) { seen[s] = true; });
    });
    state.sources.forEach(function (s) { seen[s] = true; });
    return Object.keys(seen).sort(function (a, b) {
      var ia = SOURCE_ORDER.indexOf(a), ib = SOURCE_ORDER.indexOf(b);
      return (ia < 0 ? 99 : ia) - (ib < 0 ? 99 : ib) || (a < b ? -1 : 1);
    });
  }

  function render() {
    var sources = sourcesIn(state.points);
    var rebuildAcceptance = sources.join() !== state.sources.join();
    state.sources = sources;
    Object.keys(CHARTS).forEach(function (name) {
      if (!state.plots[name] || (name === "acceptance" && rebuildAcceptance)) {
        build(name);
      } else {
        state.plots[name].setData(dataOf(name));
      }
      var box = byId(CHARTS[name].el);
      var empty = box.querySelector(".empty");
      if (!state.points.length && !empty) {
        empty = document.createElement("div");
        empty.className = "empty";
        empty.textContent = "waiting for the first points…";
        box.appendChild(empty);
      } else if (state.points.length && empty) {
        empty.remove();
      }
    });
    renderFigures();
  }

  // The deltas of the newest points (FIGURE_SPAN_MS of them) summed: rates over a few intervals, not one.
  function recent() {
    var n = state.points.length;
    var total = {};
    SUMMED.forEach(function (k) { total[k] = 0; });
    for (var i = n - 1; i >= 0 && state.points[n - 1].t - state.points[i].t < FIGURE_SPAN_MS; i--) {
      SUMMED.forEach(function (k) { total[k] += state.points[i][k] || 0; });
    }
    return total;
  }

  function ratio(a, b) { return b ? a / b : null; }

  function setFigure(id, text, cls) {
    var el = byId(id);
    el.textContent = text;
    el.className = "value" + (cls ? " " + cls : "");
  }

  function age(s) {
    if (s == null) { return "—"; }
    if (s < 90) { return Math.round(s) + " s"; }
    if (s < 5400) { return (s / 60).toFixed(1) + " min"; }
    return (s / 3600).toFixed(1) + " h";
  }

  function renderFigures() {
    var sum = recent();
    // the same definitions as the service's: see estimated_speedup and the rollup's derive()
    var speedup = sum.speedup_steps && sum.speedup_step_seconds ?
      sum.speedup_tokens / sum.speedup_step_seconds * (sum.speedup_plain_seconds / sum.speedup_steps) : null;
    var mat = ratio(sum.accepted_tokens, sum.accepted_steps);
    var acc = ratio(sum.confirmed_tokens, sum.drafted_tokens);
    var rate = ratio(sum.drafts, sum.interval_s);
    var last = state.points.length ? state.points[state.points.length - 1] : null;
    setFigure("fig-speedup", speedup == null ? "—" : speedup.toFixed(2) + "×",
              speedup == null ? "" : (speedup >= 1 ? "good" : "bad"));
    setFigure("fig-mat", mat == null ? "—" : mat.toFixed(2));
    setFigure("fig-acceptance", acc == null ? "—" : (acc * 100).toFixed(1) + " %");
    setFigure("fig-rate", rate == null ? "—" : rate.toFixed(1));
    setFigure("fig-health", last ? (last.healthy ? "healthy" : "unreachable") : "—",
              last ? (last.healthy ? "good" : "bad") : "");
    setFigure("fig-age", last ? age(last.index_age_s) : "—");
  }

  function setStatus(text, cls) {
    var el = byId("status");
    el.textContent = text;
    el.className = "status" + (cls ? " " + cls : "");
  }

  function fetchJSON(url) {
    return fetch(url, {cache: "no-store"}).then(function (r) {
      return r.json().then(function (body) {
        if (!r.ok) { throw new Error(body && body.error ? body.error : "HTTP " + r.status); }
        return body;
      });
    });
  }

  function load(initial) {
    var gen = state.generation;
    var since = initial ? Math.max(0, Date.now() - state.windowS * 1000) : state.lastT;
    var url = "/api/series?namespace=" + encodeURIComponent(state.namespace) + "&since=" + Math.floor(since) +
      (initial ? "&max_points=" + MAX_POINTS : "");
    return fetchJSON(url).then(function (body) {
      if (gen !== state.generation) { return; }  // the namespace or window changed meanwhile
      var fresh = body.points.filter(function (p) { return p.t > state.lastT; });
      state.points = state.points.concat(fresh);
      if (state.points.length) { state.lastT = state.points[state.points.length - 1].t; }
      var oldest = body.now - state.windowS * 1000;
      var cut = 0;
      while (cut < state.points.length && state.points[cut].t < oldest) { cut++; }
      if (cut) { state.points = state.points.slice(cut); }
      state.polls += 1;
      render();
      state.ready = true;
      setStatus("live · " + state.points.length + " points · updated " + new Date().toLocaleTimeString(), "live");
    });
  }

  function schedule() {
    clearTimeout(state.timer);
    state.timer = setTimeout(function () {
      load(false).catch(function (err) {
        state.errors += 1;
        setStatus("cannot reach the service: " + err.message, "error");
      }).then(schedule);
    }, POLL_MS);
  }

  function restart() {
    state.generation += 1;
    state.points = [];
    state.lastT = 0;
    state.sources = [];
    Object.keys(state.plots).forEach(function (name) { state.plots[name].destroy(); delete state.plots[name]; });
    load(true).catch(function (err) {
      state.errors += 1;
      setStatus("cannot load the series: " + err.message, "error");
    }).then(schedule);
  }

  function loadNamespaces(wanted) {
    var nsSelect = byId("namespace");
    fetchJSON("/api/namespaces").then(function (body) {
      body.namespaces.forEach(function (name) {
        var opt = document.createElement("option");
        opt.value = opt.textContent = name;
        nsSelect.appendChild(opt);
      });
      nsSelect.value = wanted && body.namespaces.indexOf(wanted) >= 0 ? wanted : body["default"];
      state.namespace = nsSelect.value;
      restart();
    }).catch(function (err) {
      setStatus("cannot reach the service: " + err.message, "error");
      setTimeout(function () { loadNamespaces(wanted); }, POLL_MS);
    });
  }

  function start() {
    var nsSelect = byId("namespace"), winSelect = byId("window");
    var wanted = new URLSearchParams(window.location.search);
    if (wanted.get("window")) { winSelect.value = wanted.get("window"); }
    state.windowS = parseInt(winSelect.value, 10) || 3600;
    loadNamespaces(wanted.get("namespace"));
    nsSelect.addEventListener("change", function () { state.namespace = nsSelect.value; restart(); });
    winSelect.addEventListener("change", function () { state.windowS = parseInt(winSelect.value, 10); restart(); });
    var pending = null;
    window.addEventListener("resize", function () {
      clearTimeout(pending);
      pending = setTimeout(function () {
        Object.keys(state.plots).forEach(function (name) { fit(name); });
      }, 100);
    });
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
}());

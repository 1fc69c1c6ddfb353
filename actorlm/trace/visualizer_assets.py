"""The visualizer's stylesheet and script, inlined into every page by ``actorlm.trace.html``.

Kept as Python strings so the page needs no package data and no network.
"""

CSS = r"""
:root {
  --waiting: #cbd5e1; --prefill: #3b82f6; --decode: #22c55e; --running: #60a5fa;
  --preempted: #f97316; --stop: #166534; --length: #7c3aed; --abort: #dc2626;
  --error: #111827; --draft: #f59e0b; --accepted: #14532d; --ink: #0f172a; --muted: #64748b; --line: #e2e8f0; --bg: #f8fafc;
  --label-w: 180px;
}
* { box-sizing: border-box; }
body { margin: 0; font: 13px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
       color: var(--ink); background: var(--bg); }
#app { padding: 14px 18px 18px; }
header { display: flex; align-items: baseline; gap: 14px; flex-wrap: wrap; }
h1 { font-size: 18px; margin: 0; font-weight: 650; letter-spacing: -0.01em; }
.sub { color: var(--muted); font-size: 12px; }
.chips { display: flex; flex-wrap: wrap; gap: 8px; margin: 10px 0 8px; }
.chip { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 5px 10px;
        min-width: 84px; }
.chip b { display: block; font-size: 16px; font-weight: 650; font-variant-numeric: tabular-nums; }
.chip span { color: var(--muted); font-size: 11px; text-transform: uppercase; letter-spacing: .04em; }
.toolbar { display: flex; flex-wrap: wrap; align-items: center; gap: 6px 10px; margin: 6px 0 10px;
           background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 7px 10px; }
.toolbar label { display: inline-flex; align-items: center; gap: 4px; cursor: pointer;
                 user-select: none; }
.toolbar select, .toolbar input[type=text] { font: inherit; padding: 2px 6px; border: 1px solid #cbd5e1;
                 border-radius: 6px; background: #fff; }
.toolbar input[type=text] { width: 120px; }
.toolbar button { font: inherit; border: 1px solid #cbd5e1; background: #fff; border-radius: 6px;
                  padding: 2px 9px; cursor: pointer; }
.toolbar button:hover { background: #f1f5f9; }
.toolbar .group { display: inline-flex; align-items: center; gap: 7px; }
.toolbar .sep { width: 1px; align-self: stretch; background: var(--line); }
.sw { display: inline-block; width: 11px; height: 11px; border-radius: 3px; }
#viewport { position: relative; overflow: auto; max-height: calc(100vh - 190px); min-height: 240px;
            background: #fff; border: 1px solid var(--line); border-radius: 8px; }
#canvas { position: relative; }
#top { position: sticky; top: 0; z-index: 4; background: #fff; border-bottom: 1px solid var(--line); }
.row { display: flex; }
.label { position: sticky; left: 0; z-index: 3; flex: none; width: var(--label-w); background: #fff;
         padding: 0 8px; border-right: 1px solid var(--line); white-space: nowrap; overflow: hidden;
         text-overflow: ellipsis; }
.track { position: relative; flex: none; }
.axis { height: 22px; }
.axis .label, .chart .label { color: var(--muted); font-size: 11px; text-transform: uppercase;
         letter-spacing: .04em; display: flex; flex-direction: column; justify-content: center; }
.tick { position: absolute; top: 0; height: 100%; border-left: 1px solid var(--line);
        font-size: 10.5px; color: var(--muted); padding: 4px 0 0 3px; white-space: nowrap; }
.chart { border-top: 1px solid var(--line); }
.chart svg { display: block; overflow: visible; }
.chart .label small { display: block; text-transform: none; letter-spacing: 0; }
.lane { height: 17px; border-bottom: 1px solid #f1f5f9; }
.lane .label { font-size: 11.5px; line-height: 17px; cursor: default; }
.lane .label small { color: var(--muted); margin-left: 4px; font-size: 10.5px; }
.lane:hover .label, .lane.hl .label { background: #eff6ff; }
.lane.hl { background: #eff6ff; }
.seg { position: absolute; top: 3px; height: 11px; min-width: 1px; }
.s-waiting { background: var(--waiting); }
.s-prefill { background: var(--prefill); }
.s-decode { background: var(--decode); }
.s-running { background: var(--running); }
.s-preempted { background: repeating-linear-gradient(135deg, var(--preempted) 0 4px, #fdba74 4px 7px); }
.s-finished { width: 5px; top: 1px; height: 15px; border-radius: 0 3px 3px 0; }
.r-stop { background: var(--stop); } .r-length { background: var(--length); }
.r-abort { background: var(--abort); } .r-error { background: var(--error); }
.spec { position: absolute; left: 0; top: 2px; width: 100%; height: 13px; overflow: visible;
        pointer-events: none; z-index: 1; }
.spec path { fill: none; stroke-width: 2px; vector-effect: non-scaling-stroke; }
.seg:hover { outline: 1.5px solid var(--ink); z-index: 1; }
.hide-waiting .s-waiting, .hide-prefill .s-prefill, .hide-decode .s-decode, .hide-decode .s-running,
.hide-preempted .s-preempted, .hide-finished .s-finished, .hide-drafts .spec { visibility: hidden; }
#band { position: absolute; top: 0; bottom: 0; background: rgba(59, 130, 246, .10);
        border-left: 1px solid rgba(59, 130, 246, .5); border-right: 1px solid rgba(59, 130, 246, .5);
        pointer-events: none; z-index: 2; }
#tip { position: fixed; z-index: 10; max-width: 380px; background: rgba(15, 23, 42, .95); color: #f8fafc;
       border-radius: 8px; padding: 8px 10px; font-size: 12px; pointer-events: none;
       box-shadow: 0 6px 18px rgba(0, 0, 0, .18); }
#tip b { color: #fff; }
#tip .k { color: #94a3b8; }
#tip .ids { color: #cbd5e1; font-size: 11px; margin-top: 4px; word-break: break-all; }
.note { color: var(--muted); font-size: 12px; margin-top: 8px; }
.empty { padding: 30px; color: var(--muted); }
"""

SCRIPT = r"""
(function () {
  'use strict';
  var DATA = JSON.parse(document.getElementById('trace-data').textContent);
  var META = DATA.meta, LANES = DATA.lanes, STEPS = DATA.steps;
  var root = document.documentElement;
  var app = document.getElementById('app');
  var tip = document.getElementById('tip');
  var LABEL_W = 180, STEPS_H = 64, KV_H = 46;
  var SVG = 'http://www.w3.org/2000/svg';
  var REASONS = ['stop', 'length', 'abort', 'error'];

  function el(tag, cls, parent, text) {
    var node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    if (parent) parent.appendChild(node);
    return node;
  }
  function svgEl(tag, attrs, parent) {
    var node = document.createElementNS(SVG, tag);
    for (var k in attrs) node.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(node);
    return node;
  }
  function fmtMs(ms) {
    if (ms === 0) return '0';
    if (ms >= 1000) return (ms / 1000).toFixed(ms >= 10000 ? 1 : 2) + ' s';
    if (ms >= 10) return ms.toFixed(0) + ' ms';
    if (ms >= 1) return ms.toFixed(1) + ' ms';
    return (ms * 1000).toFixed(0) + ' \u00b5s';
  }
  function fmtInt(n) { return Number(n).toLocaleString('en-US'); }
  function esc(s) {
    return String(s).replace(/[&<>"]/g, function (c) {
      return {'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;'}[c];
    });
  }

  // ---- the summary's figures, computed by actorlm.trace.html -------------------------------
  var SUM = DATA.summary;
  var totalKv = META.num_kv_blocks || Math.max(1, SUM.peak_kv_blocks);
  var tokenScale = Math.max(SUM.max_step_tokens, META.max_num_batched_tokens || 0, 1);

  // ---- the x axis: time, or steps (each step one unit wide) ---------------------------------
  var knotT = [], knotX = [];
  STEPS.forEach(function (s, i) { knotT.push(s[1], s[2]); knotX.push(i, i + 1); });
  function stepCoord(t) {
    var n = knotT.length;
    if (!n || t <= knotT[0]) return 0;
    if (t >= knotT[n - 1]) return knotX[n - 1];
    var lo = 0, hi = n - 1;
    while (hi - lo > 1) { var mid = (lo + hi) >> 1; if (knotT[mid] <= t) lo = mid; else hi = mid; }
    var span = knotT[hi] - knotT[lo];
    return span > 0 ? knotX[lo] + (knotX[hi] - knotX[lo]) * (t - knotT[lo]) / span : knotX[hi];
  }
  var mode = 'time', zoom = 1;
  function domainEnd() {
    // a little room on the right, so the last finish marker is not cut off
    return mode === 'time' ? Math.max(META.duration_ms * 1.006, 1e-3) : Math.max(STEPS.length + 0.5, 1);
  }
  function frac(t) {
    var x = mode === 'time' ? t : stepCoord(t);
    return Math.min(1, Math.max(0, x / domainEnd()));
  }
  function pct(f) { return (f * 100).toFixed(4) + '%'; }

  // ---- header, chips, toolbar -------------------------------------------------------------
  var header = el('header', '', app);
  el('h1', '', header, META.title || 'actorlm trace');
  var conf = [];
  if (META.model) conf.push(META.model);
  if (META.num_kv_blocks) conf.push(META.num_kv_blocks + ' KV blocks \u00d7 ' + META.block_size + ' tokens');
  if (META.max_num_batched_tokens) conf.push('budget ' + META.max_num_batched_tokens + ' tokens / ' + META.max_num_seqs + ' seqs');
  if (META.max_model_len) conf.push('max_model_len ' + META.max_model_len);
  if (META.num_speculative_tokens) conf.push('speculative decoding: up to ' + META.num_speculative_tokens + ' drafts');
  if (META.wall_time) conf.push(new Date(META.wall_time * 1000).toISOString().replace('T', ' ').slice(0, 19) + ' UTC');
  el('span', 'sub', header, conf.join(' \u00b7 '));

  var chips = el('div', 'chips', app);
  function chip(figure, value, label, color) {
    var c = el('div', 'chip', chips);
    c.setAttribute('data-figure', figure);
    var b = el('b', '', c, value);
    if (color) b.style.color = color;
    el('span', '', c, label);
    return c;
  }
  chip('requests', fmtInt(LANES.length), 'requests');
  chip('steps', fmtInt(STEPS.length), 'steps');
  chip('duration', fmtMs(META.duration_ms || 0), 'duration');
  chip('mean-step', SUM.mean_step_ms === null ? '\u2013' : fmtMs(SUM.mean_step_ms), 'mean step');
  chip('prefill-tokens', fmtInt(SUM.num_prefill_tokens), 'prefill tokens', 'var(--prefill)');
  chip('decode-tokens', fmtInt(SUM.num_decode_tokens), 'decode tokens', 'var(--decode)');
  chip('preemptions', SUM.num_preempted + ' / ' + SUM.num_preemptions, 'preempted reqs / times',
       'var(--preempted)');
  chip('peak-kv', Math.round(100 * SUM.peak_kv_blocks / totalKv) + '%', 'peak KV use');
  if (SUM.peak_kv_blocks_per_group.length > 1) {
    chip('peak-kv-groups', SUM.peak_kv_blocks_per_group.join(' / '), 'peak blocks per KV-cache group (' +
      SUM.kv_cache_windows.map(function (w) { return w === null ? 'full' : 'window ' + w; }).join(' / ') + ')');
  }
  if (SUM.cache_hit_rate !== null) {
    chip('cache-hit-rate', SUM.cache_hit_rate + '%', 'cache hit rate').title =
      fmtInt(SUM.num_cached_tokens) + ' of ' + fmtInt(SUM.num_admitted_tokens) +
      ' tokens at admission found in the prefix cache';
  }
  if (SUM.num_verifications) {
    chip('draft-acceptance', SUM.draft_acceptance_rate + '%', 'drafts accepted', 'var(--accepted)').title =
      fmtInt(SUM.num_accepted_drafts) + ' of ' + fmtInt(SUM.num_draft_tokens) + ' draft tokens accepted in ' +
      fmtInt(SUM.num_verifications) + ' verifications';
    chip('acceptance-length', SUM.mean_acceptance_length.toFixed(2), 'tokens per verification');
  }
  REASONS.forEach(function (r) {
    if (SUM.by_reason[r]) chip('finished-' + r, fmtInt(SUM.by_reason[r]), 'finished: ' + r, 'var(--' + r + ')');
  });
  if (SUM.num_open) chip('still-live', fmtInt(SUM.num_open), 'still live');

  var bar = el('div', 'toolbar', app);
  var legend = el('span', 'group', bar);
  var kinds = [['waiting', 'waiting'], ['prefill', 'prefill'], ['decode', 'decode'],
               ['preempted', 'preempted'], ['finished', 'finished']];
  if (SUM.num_verifications) kinds.push(['drafts', 'drafts (accepted: dark)']);
  kinds.forEach(function (kind) {
    var lab = el('label', '', legend);
    var box = el('input', '', lab); box.type = 'checkbox'; box.checked = true;
    box.setAttribute('data-kind', kind[0]);
    var sw = el('span', 'sw', lab);
    sw.style.background = kind[0] === 'finished' ? 'var(--stop)' : kind[0] === 'preempted' ? 'var(--preempted)'
      : kind[0] === 'drafts' ? 'linear-gradient(var(--draft) 50%, var(--accepted) 50%)' : 'var(--' + kind[0] + ')';
    el('span', '', lab, kind[1]);
    box.addEventListener('change', function () { app.classList.toggle('hide-' + kind[0], !box.checked); });
  });
  el('span', 'sep', bar);
  var filters = el('span', 'group', bar);
  function select(parent, label, options) {
    var lab = el('label', '', parent, label + ' ');
    var s = el('select', '', lab);
    options.forEach(function (o) { var opt = el('option', '', s, o[1]); opt.value = o[0]; });
    return s;
  }
  var stateSel = select(filters, 'show', [['all', 'all requests'], ['preempted', 'ever preempted'],
    ['finished', 'finished'], ['live', 'still live'], ['waiting', 'never scheduled']]);
  var reasonSel = select(filters, 'reason', [['any', 'any']].concat(REASONS.map(function (r) { return [r, r]; })));
  var idBox = el('input', '', filters); idBox.type = 'text'; idBox.placeholder = 'request id or /re/';
  var sortSel = select(filters, 'sort', [['arrival', 'arrival'], ['latency', 'latency'],
    ['preemptions', 'preemptions'], ['id', 'id']]);
  el('span', 'sep', bar);
  var zoomGroup = el('span', 'group', bar);
  var axisSel = select(zoomGroup, 'x', [['time', 'time'], ['step', 'steps']]);
  var zoomOut = el('button', '', zoomGroup, '\u2212'); zoomOut.title = 'zoom out';
  var zoomIn = el('button', '', zoomGroup, '+'); zoomIn.title = 'zoom in (or ctrl + wheel)';
  var zoomFit = el('button', '', zoomGroup, 'fit');
  var zoomText = el('span', 'sub', zoomGroup, '1\u00d7');

  // ---- the chart ----------------------------------------------------------------------------
  var viewport = el('div', '', app); viewport.id = 'viewport';
  var canvas = el('div', '', viewport); canvas.id = 'canvas';
  var top = el('div', '', canvas); top.id = 'top';
  var axisRow = el('div', 'row axis', top);
  el('div', 'label', axisRow, 'time');
  var axisTrack = el('div', 'track', axisRow);
  var axisLabel = axisRow.firstChild;

  var stepsRow = el('div', 'row chart', top);
  var stepsLabel = el('div', 'label', stepsRow, 'steps');
  el('small', '', stepsLabel, 'tokens per step');
  var stepsTrack = el('div', 'track', stepsRow);
  var stepsSvg = svgEl('svg', {width: '100%', height: STEPS_H}, stepsTrack);
  var kvRow = el('div', 'row chart', top);
  var kvLabel = el('div', 'label', kvRow, 'KV cache');
  el('small', '', kvLabel, totalKv + ' blocks');
  var kvTrack = el('div', 'track', kvRow);
  var kvSvg = svgEl('svg', {width: '100%', height: KV_H}, kvTrack);

  var lanesBox = el('div', '', canvas); lanesBox.id = 'lanes';
  var bandLayer = el('div', '', canvas);
  bandLayer.style.cssText = 'position:absolute;top:0;bottom:0;pointer-events:none;left:' + LABEL_W + 'px';
  var band = el('div', '', bandLayer); band.id = 'band'; band.hidden = true;

  var stepRects = [], kvRects = [], segEls = [], specMarks = [], rows = [], rowById = {};
  var maxDrafts = META.num_speculative_tokens || 1;
  LANES.forEach(function (l) { l[11].forEach(function (v) { maxDrafts = Math.max(maxDrafts, v[2]); }); });
  var shown = Math.min(LANES.length, META.max_lanes || 3000);

  function total(list) { return list.reduce(function (a, x) { return a + x; }, 0); }
  STEPS.forEach(function (s, k) {
    // rejected drafts were computed for nothing: drawn atop the decode tokens they are part of
    var drafted = total(s[19]), accepted = total(s[20]), px = (STEPS_H - 10) / tokenScale;
    var y = STEPS_H - 4, hp = px * s[3], hr = px * (drafted - accepted), hd = px * s[4] - hr;
    var g = svgEl('g', {'data-step': k}, stepsSvg);
    if (drafted) { g.setAttribute('data-draft-tokens', drafted); g.setAttribute('data-accepted-tokens', accepted); }
    var p = svgEl('rect', {y: y - hp, height: Math.max(hp, 0), fill: 'var(--prefill)'}, g);
    var d = svgEl('rect', {y: y - hp - hd, height: Math.max(hd, 0), fill: 'var(--decode)'}, g);
    var r = svgEl('rect', {y: y - hp - hd - hr, height: Math.max(hr, 0), fill: 'var(--draft)'}, g);
    var hit = svgEl('rect', {y: 0, height: STEPS_H, fill: 'transparent'}, g);
    var marks = [r];
    if (s[11].length) marks.push(svgEl('rect', {y: 0, height: 5, fill: 'var(--preempted)'}, g));
    if (s[12].length) marks.push(svgEl('rect', {y: 0, height: 5, fill: 'var(--abort)'}, g));
    stepRects.push([s, [p, d, hit].concat(marks)]);
    var kh = (KV_H - 6) * s[5] / totalKv;
    kvRects.push([s, svgEl('rect', {y: KV_H - kh, height: kh, fill: 'rgba(124, 58, 237, .55)', 'data-step': k}, kvSvg)]);
  });
  svgEl('line', {x1: 0, x2: '100%', y1: 6, y2: 6, stroke: '#a78bfa', 'stroke-dasharray': '3 3'}, kvSvg);
  var budgetY = STEPS_H - 4 - (STEPS_H - 10) * (META.max_num_batched_tokens || tokenScale) / tokenScale;
  svgEl('line', {x1: 0, x2: '100%', y1: budgetY, y2: budgetY, stroke: '#93c5fd', 'stroke-dasharray': '3 3'}, stepsSvg);

  for (var i = 0; i < shown; i++) {
    var lane = LANES[i];
    var row = el('div', 'row lane', lanesBox);
    row.setAttribute('data-request-id', lane[0]);
    row.setAttribute('data-lane', i);
    row.setAttribute('data-cached-tokens', lane[8]);
    if (lane[12] !== null) row.setAttribute('data-lora', lane[12]);
    var label = el('div', 'label', row, lane[0]);
    label.setAttribute('data-lane', i);
    el('small', '', label, (lane[12] !== null ? lane[12] + ' \u00b7 ' : '') +
      lane[1] + '\u2192' + lane[2] + (lane[8] ? ' \u00b7 ' + lane[8] + ' cached' : '') +
      (lane[9] ? ' \u00b7 ' + lane[10] + '/' + lane[9] + ' drafts' : '') + (lane[5] ? ' \u21bb' + lane[5] : ''));
    var track = el('div', 'track', row);
    lane[7].forEach(function (seg, j) {
      var cls = seg[0] === 'running' ? 's-' + (seg[5] || 'running')
        : seg[0] === 'finished' ? 's-finished r-' + (lane[3] || 'stop') : 's-' + seg[0];
      var node = el('div', 'seg ' + cls, track);
      node.setAttribute('data-state', seg[0]);
      if (seg[0] === 'running' && seg[5]) node.setAttribute('data-phase', seg[5]);
      if (seg[0] === 'finished') node.setAttribute('data-reason', lane[3] || '');
      node.setAttribute('data-seg', i + ':' + j);
      segEls.push([seg, node]);
    });
    if (lane[11].length) {
      row.setAttribute('data-draft-tokens', lane[9]);
      row.setAttribute('data-accepted-tokens', lane[10]);
      // one mark per verification, as two paths (not one node each: lanes x steps is many)
      var spec = svgEl('svg', {'class': 'spec', viewBox: '0 0 1 1', preserveAspectRatio: 'none',
                               'data-verifications': lane[11].length}, track);
      specMarks.push([lane[11], svgEl('path', {stroke: 'var(--draft)'}, spec),
                      svgEl('path', {stroke: 'var(--accepted)'}, spec)]);
    }
    rows.push(row);
    rowById[lane[0]] = row;
  }
  if (!LANES.length) el('div', 'empty', lanesBox, 'No requests in this trace.');
  var note = el('div', 'note', app);
  if (shown < LANES.length) note.textContent = 'Showing the first ' + shown + ' of ' + LANES.length + ' requests.';
  if (META.num_dropped) note.textContent += ' The ring buffer dropped ' + fmtInt(META.num_dropped) + ' older records: early requests may be cut.';

  // ---- layout -------------------------------------------------------------------------------
  function trackWidth() { return Math.max(200, (viewport.clientWidth - LABEL_W - 2) * zoom); }
  function place() {
    segEls.forEach(function (pair) {
      var seg = pair[0], node = pair[1], a = frac(seg[1]);
      node.style.left = pct(a);
      if (seg[0] !== 'finished') node.style.width = pct(Math.max(0, frac(seg[2]) - a));
    });
    stepRects.forEach(function (pair) {
      var a = frac(pair[0][1]), b = frac(pair[0][2]);
      pair[1].forEach(function (r) { r.setAttribute('x', pct(a)); r.setAttribute('width', pct(Math.max(b - a, 0.0004))); });
    });
    specMarks.forEach(function (m) {
      var drafted = '', accepted = '';
      m[0].forEach(function (v) {  // [t_start, t_end, drafts, accepted] of each verification
        var x = ((frac(v[0]) + frac(v[1])) / 2).toFixed(6);
        drafted += 'M' + x + ' 1V' + (1 - v[2] / maxDrafts).toFixed(3);
        if (v[3]) accepted += 'M' + x + ' 1V' + (1 - v[3] / maxDrafts).toFixed(3);
      });
      m[1].setAttribute('d', drafted);
      m[2].setAttribute('d', accepted || 'M0 1');
    });
    kvRects.forEach(function (pair, k) {
      var a = frac(pair[0][1]);
      var b = k + 1 < kvRects.length ? frac(kvRects[k + 1][0][1]) : frac(pair[0][2]);
      pair[1].setAttribute('x', pct(a)); pair[1].setAttribute('width', pct(Math.max(b - a, 0.0004)));
    });
  }
  function niceStep(raw) {
    var p = Math.pow(10, Math.floor(Math.log10(raw))), m = raw / p;
    return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10) * p;
  }
  function drawAxis(width) {
    axisTrack.textContent = '';
    axisLabel.textContent = mode === 'time' ? 'time' : 'step';
    var end = domainEnd(), step = niceStep(end / Math.max(2, width / 110));
    if (mode === 'step') step = Math.max(1, Math.round(step));
    for (var x = 0; x <= end + 1e-9; x += step) {
      var t = el('div', 'tick', axisTrack, mode === 'time' ? fmtMs(x) : String(Math.round(x)));
      t.style.left = pct(x / end);
    }
  }
  function layout() {
    var width = trackWidth();
    [axisTrack, stepsTrack, kvTrack].concat(rows.map(function (r) { return r.lastChild; }))
      .forEach(function (t) { t.style.width = width + 'px'; });
    canvas.style.width = (LABEL_W + width) + 'px';
    bandLayer.style.width = width + 'px';
    drawAxis(width);
    zoomText.textContent = (zoom < 10 ? zoom.toFixed(zoom < 2 ? 2 : 1) : Math.round(zoom)) + '\u00d7';
  }
  function setZoom(z, anchorX) {
    var old = zoom, ax = anchorX === undefined ? (viewport.clientWidth - LABEL_W) / 2 : anchorX;
    zoom = Math.min(4096, Math.max(1, z));
    var pos = viewport.scrollLeft + ax;
    layout();
    viewport.scrollLeft = Math.max(0, pos * zoom / old - ax);
  }
  zoomIn.addEventListener('click', function () { setZoom(zoom * 2); });
  zoomOut.addEventListener('click', function () { setZoom(zoom / 2); });
  zoomFit.addEventListener('click', function () { setZoom(1); viewport.scrollLeft = 0; });
  viewport.addEventListener('wheel', function (e) {
    if (!(e.ctrlKey || e.metaKey)) return;
    e.preventDefault();
    var rect = viewport.getBoundingClientRect();
    setZoom(zoom * (e.deltaY < 0 ? 1.25 : 0.8), Math.max(0, e.clientX - rect.left - LABEL_W));
  }, {passive: false});
  axisSel.addEventListener('change', function () { mode = axisSel.value; place(); layout(); });
  window.addEventListener('resize', layout);

  // ---- filters ------------------------------------------------------------------------------
  function matcher() {
    var q = idBox.value.trim();
    if (!q) return function () { return true; };
    if (q.length > 2 && q[0] === '/' && q[q.length - 1] === '/') {
      try { var re = new RegExp(q.slice(1, -1)); return function (id) { return re.test(id); }; }
      catch (err) { return function () { return false; }; }
    }
    return function (id) { return id.indexOf(q) >= 0; };
  }
  function applyFilters() {
    var want = stateSel.value, reason = reasonSel.value, match = matcher(), visible = 0;
    rows.forEach(function (row, k) {
      var l = LANES[k], ok = match(l[0]);
      if (ok && want === 'preempted') ok = l[5] > 0;
      if (ok && want === 'finished') ok = !l[6];
      if (ok && want === 'live') ok = l[6];
      if (ok && want === 'waiting') ok = !l[7].some(function (s) { return s[0] === 'running'; });
      if (ok && reason !== 'any') ok = l[3] === reason;
      row.style.display = ok ? '' : 'none';
      if (ok) visible += 1;
    });
    root.setAttribute('data-visible-lanes', visible);
  }
  function applySort() {
    var order = rows.map(function (r, k) { return k; });
    var key = sortSel.value;
    function latency(l) { var s = l[7]; return s.length ? s[s.length - 1][2] - s[0][1] : 0; }
    if (key === 'latency') order.sort(function (a, b) { return latency(LANES[b]) - latency(LANES[a]); });
    if (key === 'preemptions') order.sort(function (a, b) { return LANES[b][5] - LANES[a][5] || a - b; });
    if (key === 'id') order.sort(function (a, b) { return LANES[a][0] < LANES[b][0] ? -1 : LANES[a][0] > LANES[b][0] ? 1 : 0; });
    order.forEach(function (k) { lanesBox.appendChild(rows[k]); });
  }
  [stateSel, reasonSel].forEach(function (s) { s.addEventListener('change', applyFilters); });
  idBox.addEventListener('input', applyFilters);
  sortSel.addEventListener('change', applySort);

  // ---- hover ----------------------------------------------------------------------------------
  function showTip(html, e) {
    tip.innerHTML = html; tip.hidden = false;
    var x = e.clientX + 14, y = e.clientY + 14, w = tip.offsetWidth, h = tip.offsetHeight;
    if (x + w > window.innerWidth - 8) x = e.clientX - w - 14;
    if (y + h > window.innerHeight - 8) y = e.clientY - h - 14;
    tip.style.left = Math.max(4, x) + 'px'; tip.style.top = Math.max(4, y) + 'px';
  }
  function kv(k, v) { return '<span class="k">' + k + '</span> ' + v; }
  function laneTip(l) {
    var s = l[7], lines = ['<b>' + esc(l[0]) + '</b>'];
    lines.push(kv('prompt', l[1]) + ' &nbsp; ' + kv('output', l[2]) + ' tokens');
    if (l[12] !== null) lines.push(kv('LoRA adapter', esc(l[12])));
    if (l[8]) lines.push(kv('prefix cache', l[8] + ' tokens found at admission'));
    if (s.length) lines.push(kv('arrived', fmtMs(s[0][1])) + ' &nbsp; ' + kv('end', fmtMs(s[s.length - 1][2])) +
      ' &nbsp; ' + kv('latency', fmtMs(s[s.length - 1][2] - s[0][1])));
    var run = s.filter(function (x) { return x[0] === 'running'; });
    if (run.length) {
      var first = run[0][1] - s[0][1];
      lines.push(kv('queued', fmtMs(first)) + ' &nbsp; ' + kv('steps', run.reduce(function (a, x) { return a + x[7]; }, 0)));
    }
    if (l[9]) lines.push(kv('drafts', l[10] + ' of ' + l[9] + ' accepted in ' + l[11].length + ' verifications'));
    if (l[5]) lines.push(kv('preempted', l[5] + '\u00d7'));
    lines.push(kv('finish', l[6] ? 'still live' : (l[3] || '?') + (l[4] !== null && l[4] !== undefined ? ' (' + esc(l[4]) + ')' : '')));
    return lines.join('<br>');
  }
  function segTip(l, seg) {
    var name = seg[0] === 'running' && seg[5] ? 'running \u00b7 ' + seg[5] : seg[0];
    var lines = ['<b>' + esc(l[0]) + '</b> \u2014 ' + name];
    if (seg[0] === 'finished') {
      lines.push(kv('reason', (l[3] || '?') + (l[4] !== null && l[4] !== undefined ? ' (' + esc(l[4]) + ')' : '')));
      lines.push(kv('at', fmtMs(seg[1])) + ' &nbsp; ' + kv('step', seg[3]) + ' &nbsp; ' + kv('output', l[2] + ' tokens'));
    } else {
      lines.push(kv('from', fmtMs(seg[1])) + ' ' + kv('to', fmtMs(seg[2])) + ' &nbsp; ' + kv('for', fmtMs(seg[2] - seg[1])));
      lines.push(kv('steps', seg[3] + '\u2013' + seg[4]));
      if (seg[0] === 'running') lines.push(kv('tokens computed', seg[6]) + ' in ' + seg[7] + ' step' + (seg[7] === 1 ? '' : 's'));
      if (seg[9]) lines.push(kv('from the prefix cache', seg[9] + ' tokens'));
      if (seg[10]) lines.push(kv('drafts', seg[11] + ' of ' + seg[10] + ' accepted'));
      if (seg[8]) lines.push(kv('blocks held', seg[8]));
    }
    lines.push(kv('prompt', l[1]) + ' &nbsp; ' + kv('preemptions', l[5]));
    return lines.join('<br>');
  }
  function stepTip(s) {
    var lines = ['<b>step ' + s[0] + '</b> \u2014 ' + fmtMs(s[2] - s[1])];
    lines.push(kv('requests', s[9].length) + ' &nbsp; ' + kv('prefill', s[3]) + ' &nbsp; ' + kv('decode', s[4]) + ' tokens');
    lines.push(kv('KV blocks', s[5] + ' used / ' + s[6] + ' free' + (s[14] ? ' (' + s[14] + ' cached)' : '')) +
      ' &nbsp; ' + kv('waiting', s[8]));
    if (s[15] && s[15].length > 1) lines.push(kv('blocks per KV-cache group', s[15].join(' / ')));
    if (s[16]) lines.push(kv('forward', fmtMs(s[16])) + (s[17] === null ? '' :
      ' &nbsp; ' + kv('router', fmtMs(s[17])) + ' &nbsp; ' + kv('experts', fmtMs(s[18]))));
    if (s[13]) lines.push(kv('cache hits', s[13] + ' tokens'));
    if (s[19].length) lines.push(kv('drafts', total(s[20]) + ' of ' + total(s[19]) + ' accepted'));
    if (s[11].length) lines.push(kv('preempted', esc(s[11].join(', '))));
    if (s[12].length) lines.push(kv('failed', esc(s[12].join(', '))));
    if (s[9].length) {
      var parts = s[9].slice(0, 40).map(function (id, k) {
        var d = s[19].length ? s[19][k] : 0;  // id:tokens, and accepted/drafts where it verified
        return esc(id) + ':' + s[10][k] + (d ? ' \u2713' + s[20][k] + '/' + d : '');
      });
      if (s[9].length > 40) parts.push('\u2026 +' + (s[9].length - 40));
      lines.push('<div class="ids">' + parts.join('  ') + '</div>');
    }
    return lines.join('<br>');
  }
  var lit = [];
  function highlight(s) {
    lit.forEach(function (r) { r.classList.remove('hl'); });
    lit = [];
    if (!s) { band.hidden = true; return; }
    s[9].forEach(function (id) { var r = rowById[id]; if (r) { r.classList.add('hl'); lit.push(r); } });
    var a = frac(s[1]), b = frac(s[2]);
    band.hidden = false; band.style.left = pct(a); band.style.width = pct(Math.max(b - a, 0));
  }
  canvas.addEventListener('mousemove', function (e) {
    var t = e.target, stepNode = t.closest ? t.closest('[data-step]') : null;
    if (stepNode) {
      var s = STEPS[+stepNode.getAttribute('data-step')];
      highlight(s); showTip(stepTip(s), e); return;
    }
    highlight(null);
    var segNode = t.closest ? t.closest('[data-seg]') : null;
    if (segNode) {
      var ij = segNode.getAttribute('data-seg').split(':'), l = LANES[+ij[0]];
      showTip(segTip(l, l[7][+ij[1]]), e); return;
    }
    var labelNode = t.closest ? t.closest('.label[data-lane]') : null;
    if (labelNode) { showTip(laneTip(LANES[+labelNode.getAttribute('data-lane')]), e); return; }
    tip.hidden = true;
  });
  canvas.addEventListener('mouseleave', function () { tip.hidden = true; highlight(null); });

  place();
  layout();
  applyFilters();
  root.setAttribute('data-rendered', 'true');
  root.setAttribute('data-lanes', rows.length);
})();
"""

// Opens snapshot pickles in PyTorch's memory viewer (torch/utils/viz/MemoryViz.js
// from PyTorch's repository) in headless Chromium and reports every script error.
//
//   node scripts/viewer-check/check.mjs [--viewer FILE] [--chromium FILE] SNAPSHOT...
//
// For each snapshot, each device the viewer offers and each of its three views
// ("Active Memory Timeline", "Allocator State History", "Active Cached Segment
// Timeline"), a fresh page loads the viewer and the snapshot (as `_memory_viz`'s
// HTML does, through the viewer's add_local_files); in "Allocator State History"
// every event is then selected, from the last back to the first, so that the
// viewer replays the history back to its first event. A page error or a console
// error fails the check. One JSON line per check; exit 0 when every check
// passed, 1 when one failed, 2 when the check could not run (no viewer file,
// no d3 or playwright-core in node_modules, no chromium).
//
// The viewer is PyTorch's code: it is read from a git-ignored folder
// (default third_party/viz/MemoryViz.js) and never committed. Its imports of
// d3 v5 from a CDN are rewritten, in memory, to the d3 v5 bundle of
// node_modules (`npm ci` in this folder), served from 127.0.0.1; the page
// reaches nothing else (every other request is refused and reported).

import {readFileSync, existsSync} from 'node:fs';
import {createServer} from 'node:http';
import {dirname, join, resolve, basename} from 'node:path';
import {fileURLToPath} from 'node:url';

const HERE = dirname(fileURLToPath(import.meta.url));
const REPO = resolve(HERE, '..', '..');
const VIEWS = [
  'Active Memory Timeline',
  'Allocator State History',
  'Active Cached Segment Timeline',
];

function usage(message) {
  process.stderr.write(`viewer-check: ${message}\n`);
  process.exit(2);
}

const args = process.argv.slice(2);
let viewerPath = process.env.QUILT_MEMORY_VIZ || join(REPO, 'third_party', 'viz', 'MemoryViz.js');
let chromiumPath = process.env.QUILT_CHROMIUM || '/usr/bin/chromium';
const snapshots = [];
for (let i = 0; i < args.length; i++) {
  if (args[i] === '--viewer') {
    viewerPath = args[++i];
  } else if (args[i] === '--chromium') {
    chromiumPath = args[++i];
  } else if (args[i].startsWith('--')) {
    usage(`unknown option ${args[i]}`);
  } else {
    snapshots.push(args[i]);
  }
}
if (snapshots.length === 0) {
  usage('no snapshot given');
}
if (!existsSync(viewerPath)) {
  usage(`no viewer at ${viewerPath} (PyTorch's torch/utils/viz/MemoryViz.js; see README "Snapshots")`);
}
if (!existsSync(chromiumPath)) {
  usage(`no chromium at ${chromiumPath}`);
}
const d3Bundle = join(HERE, 'node_modules', 'd3', 'dist', 'd3.min.js');
if (!existsSync(d3Bundle)) {
  usage(`no ${d3Bundle}: run npm ci in ${HERE}`);
}
let chromium;
try {
  ({chromium} = await import('playwright-core'));
} catch (e) {
  usage(`playwright-core cannot be loaded (${e.message}): run npm ci in ${HERE}`);
}
for (const s of snapshots) {
  if (!existsSync(s)) {
    usage(`no snapshot at ${s}`);
  }
}

// The viewer's CDN imports, each replaced by names taken from the d3 v5 bundle
// (window.d3; its d3.event is the live getter the viewer's handlers read).
const IMPORTS = [
  [/^import \* as d3 from "https:\/\/cdn\.skypack\.dev\/d3@5";$/m, 'const d3 = window.d3;'],
  [/^import \{axisLeft\} from "https:\/\/cdn\.skypack\.dev\/d3-axis@1";$/m, 'const {axisLeft} = window.d3;'],
  [/^import \{scaleLinear\} from "https:\/\/cdn\.skypack\.dev\/d3-scale@1";$/m, 'const {scaleLinear} = window.d3;'],
  [/^import \{zoom, zoomIdentity\} from "https:\/\/cdn\.skypack\.dev\/d3-zoom@1";$/m, 'const {zoom, zoomIdentity} = window.d3;'],
  [/^import \{brushX\} from "https:\/\/cdn\.skypack\.dev\/d3-brush@1";$/m, 'const {brushX} = window.d3;'],
];
let viewer = readFileSync(viewerPath, 'utf8');
for (const [pattern, replacement] of IMPORTS) {
  if (!pattern.test(viewer)) {
    usage(`${viewerPath}: no import line matching ${pattern} (another version of the viewer?)`);
  }
  viewer = viewer.replace(pattern, replacement);
}
if (/^import /m.test(viewer)) {
  usage(`${viewerPath}: an import this script does not serve locally: ${viewer.match(/^import .*$/m)[0]}`);
}

const PAGE = `<!DOCTYPE html>
<html><head><meta charset="utf-8"></head><body>
<script src="/d3.min.js"></script>
<script type="module">
import {add_local_files} from '/MemoryViz.js';
window.viewer = {add_local_files};
window.viewerLoaded = true;
</script>
</body></html>`;

const files = {
  '/': ['text/html', PAGE],
  '/d3.min.js': ['text/javascript', readFileSync(d3Bundle)],
  '/MemoryViz.js': ['text/javascript', viewer],
};
const server = createServer((req, res) => {
  const path = new URL(req.url, 'http://127.0.0.1').pathname;
  if (path.startsWith('/snapshot/')) {
    const i = Number(path.slice('/snapshot/'.length));
    res.writeHead(200, {'content-type': 'application/octet-stream'});
    res.end(readFileSync(snapshots[i]));
    return;
  }
  const f = files[path];
  if (!f) {
    res.writeHead(404);
    res.end();
    return;
  }
  res.writeHead(200, {'content-type': f[0]});
  res.end(f[1]);
});
await new Promise(r => server.listen(0, '127.0.0.1', r));
const origin = `http://127.0.0.1:${server.address().port}`;

let browser;
try {
  browser = await chromium.launch({
  executablePath: chromiumPath,
  headless: true,
  args: [
    '--headless',
    '--no-sandbox',
    '--disable-gpu',
    '--disable-background-networking',
    '--disable-component-update',
    '--disable-sync',
    '--no-first-run',
  ],
  });
} catch (e) {
  server.close();
  usage(`${chromiumPath} does not start: ${e.message}`);
}

// Loads `snapshot` in a fresh page in `view` on `device` (null: the one the
// viewer picks first); in the state history selects every event, last to
// first. Returns what was seen and every error.
async function check(index, view, device) {
  const page = await browser.newPage();
  const errors = [];
  page.on('pageerror', e => errors.push(`page error: ${e.stack || e.message}`));
  page.on('console', m => {
    if (m.type() === 'error') {
      errors.push(`console error: ${m.text()}`);
    }
  });
  page.on('requestfailed', r => errors.push(`request failed: ${r.url()}`));
  await page.route('**/*', route =>
    route.request().url().startsWith(origin) ? route.continue() : route.abort(),
  );
  const seen = {};
  try {
    await page.goto(`${origin}/`);
    await page.waitForFunction(() => window.viewerLoaded === true, null, {timeout: 20000});
    const devices = await page.evaluate(
      async ({url, name, view}) => {
        const data = new Uint8Array(await (await fetch(url)).arrayBuffer());
        let binary = '';
        for (let i = 0; i < data.length; i += 0x8000) {
          binary += String.fromCharCode(...data.subarray(i, i + 0x8000));
        }
        window.viewer.add_local_files([{name, base64: btoa(binary)}], view);
        const gpu = document.querySelectorAll('body > select')[2];
        return [...gpu.options].map(o => Number(o.value));
      },
      {url: `${origin}/snapshot/${index}`, name: basename(snapshots[index]), view},
    );
    seen.devices = devices;
    if (device !== null && device !== devices[0]) {
      await page.evaluate(d => {
        const gpu = document.querySelectorAll('body > select')[2];
        gpu.value = String(d);
        gpu.dispatchEvent(new Event('change'));
      }, device);
    }
    // Let the view draw (the state history selects its last event in an
    // animation frame).
    await page.evaluate(() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r))));
    const drawn = await page.evaluate(view => {
      const shown = [...document.querySelectorAll('body > div')].filter(
        d => (d.getAttribute('style') || '').startsWith('display: float'),
      );
      if (shown.length !== 1) {
        return {error: `${shown.length} views shown`};
      }
      const div = shown[0];
      const out = {
        svgs: div.querySelectorAll('svg').length,
        polygons: div.querySelectorAll('polygon').length,
        rects: div.querySelectorAll('rect').length,
      };
      if (view === 'Allocator State History') {
        const rows = [...div.querySelectorAll('pre')].filter(p => p.__data__ !== undefined);
        out.events = rows.length;
        out.selected = 0;
        // Every event, from the last back to the first: each selection
        // replays the history back from the snapshot to that event.
        for (let i = rows.length - 1; i >= 0; i--) {
          rows[i].dispatchEvent(new MouseEvent('mousedown', {bubbles: true}));
          out.selected++;
        }
        const pres = div.querySelectorAll('pre');
        out.first_state = pres[pres.length - 1].textContent.split('\n')[0];
        out.rects_at_first = div.querySelectorAll('svg rect').length;
      }
      return out;
    }, view);
    Object.assign(seen, drawn);
    if (drawn.error) {
      errors.push(drawn.error);
    }
  } catch (e) {
    errors.push(`harness: ${e.message}`);
  }
  await page.close();
  return {seen, errors};
}

let failed = 0;
let checks = 0;
for (let i = 0; i < snapshots.length; i++) {
  // The devices the viewer offers, from a first load.
  const first = await check(i, VIEWS[0], null);
  const devices = first.seen.devices && first.seen.devices.length ? first.seen.devices : [null];
  for (const device of devices) {
    for (const view of VIEWS) {
      const r = device === devices[0] && view === VIEWS[0] ? first : await check(i, view, device);
      checks++;
      const ok = r.errors.length === 0;
      if (!ok) {
        failed++;
      }
      process.stdout.write(
        JSON.stringify({snapshot: snapshots[i], device, view, ok, ...r.seen, errors: r.errors}) + '\n',
      );
    }
  }
}
await browser.close();
server.close();
process.stdout.write(`viewer-check: ${checks - failed} of ${checks} checks passed, ${failed} failed\n`);
process.exit(failed ? 1 : 0);

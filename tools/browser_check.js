// Injected into every page by tools/browser_check.py (Playwright add_init_script).
// Python calls one function at a time: window.__bc[name](path), where `path` is the
// notebook's path in JupyterLab. Everything that touches JupyterLab's objects is here.
window.__bc = {
  // the notebook panel open on `path`, or null
  panel(path) {
    const app = window.jupyterapp;
    if (!app || !app.shell) return null;
    for (const w of app.shell.widgets('main')) {
      if (w.context && w.context.path === path && w.content && w.content.model
          && w.sessionContext) return w;
    }
    return null;
  },

  kernel(path) {
    const p = this.panel(path);
    return p && p.sessionContext.session && p.sessionContext.session.kernel;
  },

  // opened, with an idle and connected kernel
  ready(path) {
    const p = this.panel(path);
    const k = this.kernel(path);
    return !!p && p.context.isReady && !!k && k.status === 'idle'
      && k.connectionStatus === 'connected';
  },

  // Wait for the notebook to open with an idle kernel, "Run All Cells", then wait until
  // it resolved, the kernel is idle and no cell runs, twice in a row (a widget callback
  // may still be busy), then for widgets to load.
  // Returns {error, status, running, seconds} (error: why it did not finish).
  async runAll(path, timeoutMs) {
    const sleep = (ms) => new Promise(r => setTimeout(r, ms));
    const opened = Date.now();
    while (!this.ready(path)) {
      if (Date.now() - opened > Math.min(timeoutMs, 120000)) {
        return {error: 'the notebook did not open with an idle, connected kernel '
                       + '(a kernel selection dialog?)'};
      }
      await sleep(250);
    }
    timeoutMs -= Date.now() - opened;
    const app = window.jupyterapp;
    const p = this.panel(path);
    app.shell.activateById(p.id);
    if (app.shell.collapseLeft) app.shell.collapseLeft();
    if (app.shell.collapseRight) app.shell.collapseRight();
    await sleep(200);
    if (app.shell.currentWidget !== p) return {error: 'the notebook is not the current widget'};
    let done = null;
    app.commands.execute('notebook:run-all-cells').then(
      r => { done = {ok: r === undefined ? true : r}; }, e => { done = {error: String(e)}; });
    const t0 = Date.now();
    let s = {};
    let stable = 0;
    while (stable < 2) {
      await sleep(500);
      s = this.state(path);
      if (s.status === 'dead') return {...s, error: 'kernel died'};
      if (Date.now() - t0 > timeoutMs) {
        return {...s, error: `not finished after ${timeoutMs / 1000} s (kernel ${s.status}, `
                             + `cells still running: [${s.running}])`};
      }
      stable = done && s.status === 'idle' && !s.running.length ? stable + 1 : 0;
    }
    const seconds = (Date.now() - t0) / 1000;
    const widgetsBy = Date.now() + 20000;
    while (this.state(path).loading && Date.now() < widgetsBy) await sleep(500);
    return {...s, seconds, error: done.error ? 'run all: ' + done.error : ''};
  },

  // kernel status, indices of running cells, widgets still "Loading widget..."
  state(path) {
    const k = this.kernel(path);
    const p = this.panel(path);
    const running = p.content.widgets.map((c, i) => {
      const prompt = c.node.querySelector('.jp-InputPrompt');
      return c.model.type === 'code' && (c.model.executionState === 'running'
        || (!!prompt && prompt.textContent.includes('*'))) ? i : -1;
    }).filter(i => i >= 0);
    const loading = Array.from(p.node.querySelectorAll('.jp-OutputArea-output'))
      .filter(n => (n.textContent || '').startsWith('Loading widget')).length;
    return {status: k ? k.status : 'no kernel', running, loading};
  },

  // every code cell checked in the notebook model and in the rendered page:
  // {code_cells, executed, widgets, images, problems: [text], warnings: [text]}
  check(path) {
    const r = {code_cells: 0, executed: 0, widgets: 0, images: 0, problems: [], warnings: []};
    const clean = (t) => (Array.isArray(t) ? t.join('') : t || '')
      .replace(/\x1b\[[0-9;]*[A-Za-z]/g, '').trim();
    const short = (t, n = 1500) => {
      t = clean(t);
      return t.length <= n ? t : '...' + t.slice(-n);
    };
    const WIDGET = 'application/vnd.jupyter.widget-view+json';
    this.panel(path).content.widgets.forEach((c, index) => {
      if (c.model.type !== 'code') return;
      const source = c.model.sharedModel.getSource();
      const where = `cell ${index} (${JSON.stringify((source.split('\n')
        .find(l => l.trim()) || '').slice(0, 80))})`;
      const say = (kind, text) => r.problems.push(`${where}: ${kind}: ${text}`);
      r.code_cells += 1;
      if (c.model.executionCount != null) r.executed += 1;
      else if (source.trim()) say('not executed', 'no execution count after Run All Cells');
      // the notebook model
      const outputs = c.model.outputs.toJSON();
      const before = r.problems.length;
      const widgetAt = [];
      outputs.forEach((out, pos) => {
        const data = out.data || {};
        if (out.output_type === 'error') {
          const tb = short((out.traceback || []).join('\n'));
          say('error output', `${out.ename}: ${out.evalue}\n${tb}`);
        } else if (out.output_type === 'stream' && out.name === 'stderr') {
          const text = clean(out.text);
          if (text.includes('Traceback (most recent call last)')) {
            say('traceback on stderr', short(text));
          } else if (text) {
            r.warnings.push(`${where} wrote to stderr: ${short(text, 300)}`);
          }
        }
        if (data[WIDGET]) widgetAt.push(pos);
        if (data['image/png'] || data['image/svg+xml']) r.images += 1;
      });
      // the page: errors in any rendered output, also inside widgets (interact's Output)
      for (const node of c.node.querySelectorAll('.jp-OutputArea-output')) {
        const text = clean(node.innerText || node.textContent);
        if (node.getAttribute('data-mime-type') === 'application/vnd.jupyter.stderr'
            && r.problems.length === before
            && (text.includes('Traceback') || /^\w+(Error|Exception)\b/m.test(text))) {
          say('error in page', short(text));
        }
        if (text.startsWith('Error displaying widget')) {
          say('widget not rendered', short(text, 300));
        }
      }
      // every widget view in the model must be a rendered widget in the page
      const children = c.outputArea ? Array.from(c.outputArea.node.children)
        .filter(ch => ch.classList.contains('jp-OutputArea-child'))
        .map(ch => ch.querySelector('.jp-OutputArea-output')) : [];
      if (widgetAt.length && children.length !== outputs.length) {
        say('widget not rendered',
            `${outputs.length} outputs in the model but ${children.length} in the page`);
        return;
      }
      for (const pos of widgetAt) {
        const node = children[pos];
        const text = node ? short(node.innerText || node.textContent, 160) : '';
        if (text.startsWith('Error displaying widget')) continue;  // reported above
        if (!node || node.getAttribute('data-mime-type') === 'text/plain'
            || text.startsWith('Loading widget')) {
          say('widget not rendered', `output ${pos} shows ${JSON.stringify(text)} instead of `
              + 'the widget (ipywidgets extension missing, or the model never arrived)');
        } else if (!node.querySelector('.jupyter-widgets, [class*="widget-"]')) {
          say('widget not rendered',
              `output ${pos} holds no widget element: ${JSON.stringify(text)}`);
        } else {
          r.widgets += 1;
        }
      }
    });
    for (const d of document.querySelectorAll('.jp-Dialog')) {  // "the kernel died" ...
      r.problems.push('notebook: dialog: ' + short(d.innerText.replace(/\s+/g, ' '), 400));
    }
    return r;
  },

  // the kernel's sys.executable and its sys.prefix (symlinks resolved), one per line
  async kernelPython(path) {
    const future = this.kernel(path).requestExecute({
      code: 'import os, sys; print(sys.executable); print(os.path.realpath(sys.prefix), end="")',
      silent: false, store_history: false});
    let out = '';
    future.onIOPub = (msg) => {
      if (msg.header.msg_type === 'stream') out += msg.content.text;
      if (msg.header.msg_type === 'error') out += 'ERROR ' + msg.content.ename;
    };
    const timeout = new Promise(r => setTimeout(() => r('timeout'), 30000));
    return (await Promise.race([future.done, timeout])) === 'timeout' ? 'TIMEOUT ' + out : out;
  },

  // scroll to the top; the page height that shows every cell (JupyterLab scrolls
  // inside the notebook, not the page)
  scrollHeight(path) {
    const p = this.panel(path);
    p.content.activeCellIndex = 0;
    p.content.deselectAll();
    const outer = p.node.querySelector('.jp-WindowedPanel-outer') || p.content.node;
    outer.scrollTop = 0;
    const cells = p.content.widgets;
    if (!cells.length) return 0;
    return Math.ceil(cells[cells.length - 1].node.getBoundingClientRect().bottom
                     + outer.scrollTop + 60);
  },

  async shutdown(path) {
    const p = this.panel(path);
    if (p) {
      await Promise.race([p.sessionContext.shutdown(),
                          new Promise(r => setTimeout(r, 15000))]);
    }
    return true;
  },
};

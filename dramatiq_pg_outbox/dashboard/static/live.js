// Live pages of the dashboard: every data-refresh seconds (on <body>), fetch this page again
// and bring its [data-live] regions up to date in place, instead of reloading the whole page.
//
// Progressive enhancement: without JavaScript the <noscript> <meta http-equiv="refresh"> of the
// page reloads it instead. No inline script, no eval: the Content-Security-Policy allows only
// this file ('self'), and fetches to this origin only.
//
// What the operator is doing is kept: nodes whose markup did not change are kept as they are
// (ticked boxes, focus, scroll, the text selected), a ticked box whose row moved is ticked again
// by its name and value, and a region is left alone while its text is being selected or one of its
// fields (text, select) is being edited. Updates stop while the tab is hidden; `?refresh=off` (the
// "pause" link) renders the page without this script.
(function () {
  "use strict";

  var body = document.body;
  var seconds = parseInt(body.getAttribute("data-refresh") || "0", 10);
  if (!(seconds > 0) || !window.fetch || !window.DOMParser) {
    return;
  }
  var period = seconds * 1000;
  var timer = null;
  var busy = false;
  var updates = 0;
  var status = null;

  // The small marker saying the last update failed (made here: the page itself has none).
  function showStatus(text) {
    if (status === null) {
      status = document.createElement("span");
      status.id = "live-status";
      status.setAttribute("role", "status");
      var place = document.querySelector("header .meta") || body;
      place.appendChild(status);
    }
    status.textContent = text;
    status.hidden = text === "";
  }

  function isEditing(node) {
    var active = document.activeElement;
    if (!active || active === body || !node.contains(active)) {
      return false;
    }
    var tag = active.tagName;
    if (tag === "SELECT" || tag === "TEXTAREA") {
      return true;
    }
    if (tag === "INPUT") {
      var type = (active.getAttribute("type") || "text").toLowerCase();
      return ["checkbox", "radio", "submit", "button", "hidden", "reset"].indexOf(type) < 0;
    }
    return active.isContentEditable;
  }

  function isSelecting(node) {
    var selection = window.getSelection ? window.getSelection() : null;
    if (!selection || selection.isCollapsed || selection.rangeCount === 0) {
      return false;
    }
    return node.contains(selection.getRangeAt(0).commonAncestorContainer);
  }

  function boxKey(input) {
    var form = input.form ? input.form.getAttribute("action") || "" : "";
    return form + "\u0000" + input.name + "\u0000" + input.value;
  }

  // The boxes the operator ticked or unticked (unlike their markup's default), by key.
  function changedBoxes(node) {
    var changed = {};
    var boxes = node.querySelectorAll("input[type=checkbox], input[type=radio]");
    for (var i = 0; i < boxes.length; i++) {
      if (boxes[i].checked !== boxes[i].defaultChecked) {
        changed[boxKey(boxes[i])] = boxes[i].checked;
      }
    }
    return changed;
  }

  function restoreBoxes(node, changed) {
    var boxes = node.querySelectorAll("input[type=checkbox], input[type=radio]");
    for (var i = 0; i < boxes.length; i++) {
      var key = boxKey(boxes[i]);
      if (Object.prototype.hasOwnProperty.call(changed, key)) {
        boxes[i].checked = changed[key];
      }
    }
  }

  function sameElement(a, b) {
    if (a.tagName !== b.tagName) {
      return false;
    }
    // A field stands for what it submits: another name or value is another field.
    if (a.tagName === "INPUT" || a.tagName === "SELECT" || a.tagName === "TEXTAREA") {
      var keys = ["type", "name", "value"];
      for (var i = 0; i < keys.length; i++) {
        if (a.getAttribute(keys[i]) !== b.getAttribute(keys[i])) {
          return false;
        }
      }
    }
    return true;
  }

  // Make `old` (in the page) look like `fresh` (fetched), touching only what differs.
  function morph(old, fresh) {
    var i;
    for (i = old.attributes.length - 1; i >= 0; i--) {
      if (!fresh.hasAttribute(old.attributes[i].name)) {
        old.removeAttribute(old.attributes[i].name);
      }
    }
    for (i = 0; i < fresh.attributes.length; i++) {
      var attribute = fresh.attributes[i];
      if (old.getAttribute(attribute.name) !== attribute.value) {
        old.setAttribute(attribute.name, attribute.value);
      }
    }
    var olds = Array.prototype.slice.call(old.childNodes);
    var news = Array.prototype.slice.call(fresh.childNodes);
    for (i = 0; i < news.length; i++) {
      var a = olds[i];
      var b = news[i];
      if (a === undefined) {
        old.appendChild(document.importNode(b, true));
      } else if (a.nodeType !== b.nodeType) {
        old.replaceChild(document.importNode(b, true), a);
      } else if (a.nodeType === Node.ELEMENT_NODE) {
        if (sameElement(a, b)) {
          morph(a, b);
        } else {
          old.replaceChild(document.importNode(b, true), a);
        }
      } else if (a.nodeValue !== b.nodeValue) {
        a.nodeValue = b.nodeValue;
      }
    }
    for (i = news.length; i < olds.length; i++) {
      old.removeChild(olds[i]);
    }
  }

  function apply(html) {
    var fetched = new DOMParser().parseFromString(html, "text/html");
    var regions = document.querySelectorAll("[data-live]");
    var found = 0;
    for (var i = 0; i < regions.length; i++) {
      var region = regions[i];
      var fresh = region.id ? fetched.getElementById(region.id) : null;
      if (fresh === null) {
        continue;
      }
      found++;
      if (isEditing(region) || isSelecting(region)) {
        continue;
      }
      var changed = changedBoxes(region);
      morph(region, fresh);
      restoreBoxes(region, changed);
    }
    return found > 0 || regions.length === 0;
  }

  function schedule(delay) {
    clearTimeout(timer);
    timer = document.hidden ? null : setTimeout(update, delay);
  }

  function update() {
    timer = null;
    if (busy || document.hidden) {
      return;
    }
    busy = true;
    var controller = window.AbortController ? new AbortController() : null;
    var deadline = setTimeout(function () {
      if (controller) {
        controller.abort();
      }
    }, Math.max(period * 2, 10000));
    fetch(window.location.href, {
      headers: { "X-Live": "1", Accept: "text/html" },
      credentials: "same-origin",
      cache: "no-store",
      redirect: "manual",
      signal: controller ? controller.signal : undefined,
    })
      .then(function (response) {
        if (response.status === 401) {
          throw new Error("logged out: reload the page to log in");
        }
        if (!response.ok) {
          throw new Error("update failed (HTTP " + (response.status || "redirect") + "), retrying");
        }
        return response.text();
      })
      .then(function (html) {
        if (!apply(html)) {
          throw new Error("update failed, retrying");
        }
        updates++;
        body.setAttribute("data-live-updates", String(updates));
        showStatus("");
      })
      .catch(function (error) {
        var text = error instanceof TypeError || error.name === "AbortError"
          ? "connection lost, retrying"
          : error.message;
        showStatus(text);
      })
      .then(function () {
        clearTimeout(deadline);
        busy = false;
        schedule(period);
      });
  }

  document.addEventListener("visibilitychange", function () {
    if (document.hidden) {
      clearTimeout(timer);
      timer = null;
    } else {
      schedule(0);
    }
  });
  body.setAttribute("data-live-updates", "0");
  schedule(period);
})();

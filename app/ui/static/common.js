// What both page scripts write values with (loaded before them by every page).
// Every value from the server is written with textContent: never HTML.
"use strict";
window.turnlogUi = (function () {
  // Directional controls (an unclosed right-to-left override reorders what follows it)
  // shown as codes, as the pages show them (app/ui/views.py, BIDI_CONTROLS).
  function shown(text) {
    return text.replace(/[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/g,
      (c) => "[U+" + c.charCodeAt(0).toString(16).toUpperCase().padStart(4, "0") + "]");
  }

  // An element with `text` (shown as above) and class `cls`, both optional.
  function el(tag, text, cls) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = shown(String(text));
    if (cls) node.className = cls;
    return node;
  }

  return Object.freeze({ shown, el });
})();

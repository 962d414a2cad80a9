// kvguard operator console: the only script the pages load (the CSP allows no inline script).
// Forms marked data-confirm ask first; a data-copy button copies the element it names.
"use strict";

document.addEventListener("submit", (event) => {
  const button = event.submitter;
  const message = button && button.dataset ? button.dataset.confirm : undefined;
  if (message && !window.confirm(message)) {
    event.preventDefault();
  }
});

document.addEventListener("click", (event) => {
  const button = event.target.closest("button[data-copy]");
  if (!button) {
    return;
  }
  const source = document.getElementById(button.dataset.copy);
  if (source && navigator.clipboard) {
    navigator.clipboard.writeText(source.textContent.trim()).then(() => {
      button.textContent = "Copied";
    });
  }
});

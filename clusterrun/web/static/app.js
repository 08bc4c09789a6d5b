// The log pane: keep following the end while the reader is at the end (scrolling up stops that,
// scrolling back down resumes it), and keep the page light by dropping the oldest lines past KEEP
// (the whole log stays on the hosts; search reads all of it). Done once per frame, not per message.
(function () {
  var KEEP = 2000;
  var stick = true;
  var pending = false;
  function frame() {
    pending = false;
    var log = document.getElementById("log");
    if (!log) { return; }
    var extra = log.childElementCount - KEEP;
    for (; extra > 0; extra--) { log.removeChild(log.firstElementChild); }
    if (stick) { log.scrollTop = log.scrollHeight; }
  }
  document.addEventListener("scroll", function (e) {
    var log = e.target;
    if (log && log.id === "log") {
      stick = log.scrollHeight - log.scrollTop - log.clientHeight < 40;
    }
  }, {capture: true, passive: true});
  document.addEventListener("htmx:sseMessage", function () {
    if (!pending) {
      pending = true;
      window.requestAnimationFrame(frame);
    }
  });
})();

"""The dashboard's static files (HTML, script, styles and the vendored uPlot), served by ``http_server``."""

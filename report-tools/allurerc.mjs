// Allure 3 configuration for `python -m conformance.report allure REPORT_DIR`, which passes the
// results directory, the output directory and the report name on the command line.
// singleFile: one self-contained index.html (data inlined), so the report can be attached to a CI
// job or mailed like report.html, and opens from file:// without a web server.
export default {
  name: "LoRA conformance",
  plugins: {
    awesome: {
      options: {
        singleFile: true,
        reportLanguage: "en",
        groupBy: ["parentSuite", "suite", "subSuite"],
      },
    },
  },
};

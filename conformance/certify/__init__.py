"""Certification: one bundle a vendor submits and anyone can verify without rerunning it (issue 34).

``lora-conformance certify`` runs a frozen case list (``conformance.caselists``) on a target, or bundles the
report dirs of runs or shards of it, and writes one .tar.gz: the results, each input's manifest, the list's
name and digest, the waivers in force, a digest per record that ties its outcome to its inputs and its
measurement, a hash index over every file, a statement for the vendor to fill in and a one-page
certificate. ``lora-conformance verify`` checks such a bundle and exits 0 (conformant), 1 (not conformant)
or 2 (invalid), naming every problem. docs/certification.md is the reader's guide.

Modules, by idea: ``archive`` (the file: safe tar reading, deterministic writing, the hash index),
``records`` (a record's digest; the verdict rules an outcome must follow from its measurement),
``against_list`` (records against the released list), ``waivers`` (central or local, and whether it
applies), ``statement`` (the vendor's statement), ``certificate`` (the HTML page), ``bundle`` (what a
bundle holds, from the runs' documents), ``verify`` (every check, the verdict), ``commands`` (the CLI).
"""

import json
import threading
import unittest
import urllib.error
import urllib.request

from inventory.server import make_server
from inventory.store import Inventory


class ServerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = make_server(Inventory.load("data/items.json"), 0)
        cls.server.RequestHandlerClass.log_message = lambda *a: None
        threading.Thread(target=cls.server.serve_forever, daemon=True).start()
        cls.base = f"http://127.0.0.1:{cls.server.server_address[1]}"

    @classmethod
    def tearDownClass(cls):
        cls.server.shutdown()
        cls.server.server_close()

    def get(self, path):
        try:
            with urllib.request.urlopen(self.base + path, timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def test_health(self):
        self.assertEqual(self.get("/health"), (200, {"ok": True, "items": 5}))

    def test_items_of_a_category(self):
        status, items = self.get("/items?category=tools")
        self.assertEqual((status, [i["sku"] for i in items]), (200, ["HAM-001", "SAW-002"]))

    def test_one_item(self):
        self.assertEqual(self.get("/items/GLU-020")[1]["name"], "Wood glue")

    def test_unknown_item_is_404(self):
        self.assertEqual(self.get("/items/NOPE-1"), (404, {"error": "no such item", "sku": "NOPE-1"}))


if __name__ == "__main__":
    unittest.main()

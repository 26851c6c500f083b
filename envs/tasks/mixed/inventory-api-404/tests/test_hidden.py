import json
import threading
import unittest
import urllib.error
import urllib.request

from inventory.server import make_server
from inventory.store import Inventory, Item


class HiddenApiTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        store = Inventory([Item("X-1", "x", "misc", 1, 1), Item("Y-2", "y", "misc", 0, 2)])
        cls.server = make_server(store, 0)
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

    def test_unknown_skus_are_404_with_the_sku(self):
        for sku in ("Z-9", "x-1", "X-10"):
            self.assertEqual(self.get(f"/items/{sku}"), (404, {"error": "no such item", "sku": sku}))

    def test_known_skus_still_answer(self):
        self.assertEqual(self.get("/items/Y-2"), (200, {"sku": "Y-2", "name": "y", "category": "misc", "stock": 0, "price_cents": 2}))

    def test_the_server_survives_a_miss(self):
        self.get("/items/none")
        self.assertEqual(self.get("/items?in_stock=1")[1][0]["sku"], "X-1")

    def test_other_paths(self):
        self.assertEqual(self.get("/items/X-1/extra"), (404, {"error": "not found"}))

    def test_store_contract(self):
        with self.assertRaises(KeyError):
            Inventory([]).get("X-1")


if __name__ == "__main__":
    unittest.main()

from django.urls import path
from wallet import views

urlpatterns = [
    path("wallets/<str:user>", views.wallet),
    path("wallets/<str:user>/top-up", views.top_up),
    path("wallets/<str:user>/charge", views.charge),
]
